"""Deployments through a real Prefect server and a real process worker."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.flows.conftest import ROOT, thresher_cmd
from thresher.errors import RecipeError
from thresher.flows.deploy import load_schedules

pytestmark = pytest.mark.slow


def test_shipped_schedules_validate():
    specs = load_schedules(ROOT / "configs" / "schedules.yaml")
    assert specs[0].cron and Path(specs[0].recipe).is_file()


def test_bad_schedule_names_the_problem(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text(yaml.safe_dump({"deployments": [{"name": "x", "recipe": "nope.yaml"}]}))
    with pytest.raises(RecipeError, match="no such recipe"):
        load_schedules(bad)


def test_deployment_runs_through_server_and_worker(tmp_path, tiny_demo, prefect_server):
    recipe = tmp_path / "dep.yaml"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe.write_text(yaml.safe_dump({
        "name": "dep", "model": str(tiny_demo),
        "eval": {"perplexity": {"seq_len": 64, "max_windows": 2}},
        "variants": [{"name": "base", "stages": []}],
        "validate": {"enabled": False},
        "tracking": {"mlflow_uri": uri},
    }))
    schedules = tmp_path / "schedules.yaml"
    schedules.write_text(yaml.safe_dump({"deployments": [
        {"name": "dep-test", "recipe": str(recipe), "cron": "0 3 * * *"}]}))
    env = {**prefect_server["env"], "THRESHER_HOME": str(tmp_path / "home")}
    prefect = str(Path(thresher_cmd()[0]).parent / "prefect")
    subprocess.run([prefect, "work-pool", "create", "thresher-test", "--type", "process"],
                   env=env, check=True, capture_output=True, timeout=120)
    out = subprocess.run(thresher_cmd("deploy", str(schedules), "--work-pool", "thresher-test"),
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", "thresher-test"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        run = subprocess.run([prefect, "deployment", "run", "compress-file/dep-test", "--watch",
                              "--watch-timeout", "420"],
                             env=env, capture_output=True, text=True, timeout=480)
    finally:
        worker.terminate()
        try:
            log, _ = worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            log = ""
    assert run.returncode == 0, run.stdout + run.stderr + log[-4000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("dep").experiment_id],
                              "attributes.status = 'FINISHED'")
    base = [r for r in runs if r.info.run_name == "base"]
    assert base, f"no finished MLflow run from the deployment; worker log:\n{log[-4000:]}"
    assert base[0].data.metrics["perplexity"] > 1
