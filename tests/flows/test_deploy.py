"""Deployments through a real Prefect server and a real process worker: the recipe is the run
form's typed parameter, prefilled from the file; an edited run executes the edit."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.flows.conftest import ROOT, thresher_cmd
from thresher.errors import RecipeError
from thresher.flows.deploy import load_schedules
from thresher.recipe import load_recipe

pytestmark = pytest.mark.slow


def test_shipped_schedules_validate():
    specs = load_schedules(ROOT / "configs" / "schedules.yaml")
    assert specs[0].cron and Path(specs[0].recipe).is_file()


def test_bad_schedule_names_the_problem(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text(yaml.safe_dump({"deployments": [{"name": "x", "recipe": "nope.yaml"}]}))
    with pytest.raises(RecipeError, match="no such recipe"):
        load_schedules(bad)


@pytest.mark.parametrize("content, words", [
    ({"deployments": [{"name": "x", "recipe": "demo.yaml", "cron": "0 3 * *"}]},
     'deployments.0.cron: Invalid cron string: "0 3 * *"'),
    ({"deployments": [{"name": "x", "recipe": "demo.yaml", "timezone": "Mars/Olympus"}]},
     "deployments.0.timezone: 'Mars/Olympus' is not an IANA time zone"),
    ({"deployments": [{"name": "x", "recipe": "demo.yaml", "crn": "0 3 * * *"}]},
     "deployments.0.crn: unknown key (a deployment takes name, recipe, cron"),
    ({"name": "r", "model": "demo:tiny", "variants": [{"name": "base"}]},
     "a recipe, where `thresher deploy` takes a schedules file naming recipes"),
])
def test_a_wrong_schedules_file_names_the_field(tmp_path, content, words):
    """A cron string or time zone Prefect would refuse mid-registration, an unknown key and a
    recipe given in a schedules file's place: one message each, naming what is wrong."""
    bad = tmp_path / "s.yaml"
    bad.write_text(yaml.safe_dump(content))
    with pytest.raises(RecipeError) as err:
        load_schedules(bad)
    assert words in str(err.value)


def test_deploy_without_a_prefect_server_says_so(tmp_path):
    """Nothing listens at the API address: exit 2 with the address and what to start."""
    out = subprocess.run(
        [*thresher_cmd(), "deploy", str(ROOT / "configs" / "schedules.yaml")],
        capture_output=True, text=True, timeout=300,
        env={**_env_without_prefect(), "PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert out.returncode == 2, out.stderr
    assert "the Prefect API at http://127.0.0.1:9/api" in out.stderr
    assert "Traceback" not in out.stderr


def _env_without_prefect() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}


def _recipe(model: Path, uri: str) -> dict:
    return {"name": "dep", "model": str(model),
            "calibration": {"samples": 4, "seq_len": 32},
            "eval": {"perplexity": {"seq_len": 64, "max_windows": 2}},
            "variants": [{"name": "reap", "stages": [{"prune": {"method": "reap", "ratio": 0.5}}]}],
            "validate": {"enabled": False},
            "tracking": {"mlflow_uri": uri}}


def test_malformed_recipe_parameter_is_refused_before_compute(tmp_path, tiny_demo, prefect_api):
    """What the server's schema cannot express (a ratio outside (0, 1)) is refused by the flow's
    first line, with the field path that `thresher check` prints."""
    from thresher.flows.compress import compress

    bad = _recipe(tiny_demo, f"sqlite:///{tmp_path / 'mlflow.db'}")
    bad["variants"][0]["stages"][0]["prune"]["ratio"] = 1.5
    with pytest.raises(RecipeError, match=r"variants\.0\.stages\.0\.prune\.ratio: ratio must be in"):
        compress(recipe=bad, store_dir=str(tmp_path / "store"))
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()


def _wait_for_run(api: str, run_id: str, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = httpx.get(f"{api}/flow_runs/{run_id}").json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(3)
    raise AssertionError(f"flow run {run_id} did not finish in {timeout} s: {run['state']}")


def test_ui_edited_run_executes_the_edit(tmp_path, tiny_demo, prefect_server):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = tmp_path / "dep.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_demo, uri)))
    schedules = tmp_path / "schedules.yaml"
    schedules.write_text(yaml.safe_dump({"deployments": [
        {"name": "dep-test", "recipe": str(recipe), "cron": "0 3 * * *"}]}))
    # PYTHONPATH: the worker's flow runs import this checkout's thresher
    env = {**prefect_server["env"], "THRESHER_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT)}
    api = prefect_server["url"]
    prefect = str(Path(sys.executable).parent / "prefect")
    subprocess.run([prefect, "work-pool", "create", "thresher-test", "--type", "process"],
                   env=env, check=True, capture_output=True, timeout=120)
    # the deployment's entrypoint is a module path: neither command needs the checkout as cwd
    out = subprocess.run(thresher_cmd("deploy", str(schedules), "--work-pool", "thresher-test"),
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr

    deployment = httpx.get(f"{api}/deployments/name/compress/dep-test").json()
    assert deployment["entrypoint"] == "thresher.flows.compress.compress"
    prefilled = deployment["parameters"]["recipe"]
    assert prefilled == load_recipe(recipe).model_dump(mode="json", by_alias=True)
    schema = deployment["parameter_openapi_schema"]
    assert deployment["enforce_parameter_schema"] and "oneOf" not in json.dumps(schema)
    quantize = schema["definitions"]["Stage"]["properties"]["quantize"]["anyOf"]
    assert [q.get("$ref", "").rsplit("/", 1)[-1] for q in quantize] == [
        "RTNStage", "GPTQStage", "AWQStage", "NF4Stage", ""]

    def start(parameters: dict) -> httpx.Response:  # what the Run page's form submits
        return httpx.post(f"{api}/deployments/{deployment['id']}/create_flow_run",
                          json={"parameters": parameters, "state": {"type": "SCHEDULED"}})

    bad = copy.deepcopy(prefilled)
    bad["variants"][0]["stages"][0]["prune"]["ratio"] = "half"
    refused = start({"recipe": bad})
    assert refused.status_code == 409 and "variants[0].stages[0].prune.ratio" in refused.text

    edited = copy.deepcopy(prefilled)
    edited["variants"][0]["stages"][0]["prune"]["ratio"] = 0.25
    created = start({"recipe": edited})
    assert created.status_code == 201, created.text
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", "thresher-test"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, cwd=tmp_path)
    try:
        run = _wait_for_run(api, created.json()["id"], 420)
    finally:
        worker.terminate()
        try:
            log, _ = worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            log = ""
    assert run["state"]["type"] == "COMPLETED", log[-4000:]
    assert run["name"].startswith("dep-")

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("dep").experiment_id])
    variant = next(r for r in runs if r.info.run_name == "reap")
    assert variant.data.params["stages"] == "prune reap ratio=0.25"
    assert variant.data.metrics["experts_kept"] == 6  # 8 experts, a quarter removed
    parent = next(r for r in runs if r.info.run_name == run["name"])

    artifacts = httpx.post(f"{api}/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [run["id"]]}}}).json()
    (summary,) = [a for a in artifacts if a["type"] == "markdown"]
    assert summary["key"] == "thresher-dep"
    assert f"/runs/{parent.info.run_id})" in summary["data"]
    assert "| reap | prune reap ratio=0.25 |" in summary["data"]
