"""A sweep fanned out over two process workers, tracked in an MLflow server, surviving a lost worker.

Real processes throughout: ``start_stack`` runs a Prefect server, an MLflow server (SQLite
backend, proxied artifacts) and two ``prefect worker`` processes; ``thresher run --pool`` is the
parent. While the parent waits, the test kills one worker's process group and its flow run's
(what a lost machine does) during a prune stage, after that worker has finished a variant.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.flows.conftest import ROOT, free_port
from thresher.flows.fanout import FLOW_RUN_TAG
from thresher.flows.stack import start_stack, stop_stack

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

VARIANTS = ["base", "frequency25-rtn3", "frequency25-rtn4", "frequency50-rtn3",
            "frequency50-rtn4"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    s = start_stack(workers=2, pool="sweep", prefect_port=free_port(), mlflow_port=free_port(),
                    root=root)
    yield s
    stop_stack(root)


def _client(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack.prefect_url}):
        return get_client(sync_client=True)


def worker_of_flow_runs(client) -> dict[str, str]:
    """Flow run id -> the name of the worker that submitted it, from the workers' events."""
    from prefect.events.filters import EventFilter, EventNameFilter

    page = client.read_events(
        EventFilter(event=EventNameFilter(name=["prefect.worker.submitted-flow-run"])), limit=50)
    out = {}
    for event in page.events:
        for related in event.related:
            if related.get("prefect.resource.role") == "flow-run":
                out[related.id.removeprefix("prefect.flow-run.")] = event.resource.name
    return out


def kill_a_worker_during_a_prune(client, stack, parent: subprocess.Popen, deadline: float) -> dict:
    """Wait for a prune stage running in a flow run whose worker already completed another flow
    run, then SIGKILL that worker's process group and the flow run's process group."""
    from prefect.client.schemas.objects import StateType

    while time.time() < deadline:
        if parent.poll() is not None:
            raise AssertionError("the parent ended early:\n" + parent.communicate()[0])
        flow_runs = {str(r.id): r for r in client.read_flow_runs()}
        workers = worker_of_flow_runs(client)
        done_by = {workers.get(fid) for fid, r in flow_runs.items()
                   if r.state_type == StateType.COMPLETED and r.parent_task_run_id}
        for task in client.read_task_runs():
            run = flow_runs.get(str(task.flow_run_id))
            worker = workers.get(str(task.flow_run_id))
            if (task.name.endswith("/0-prune") and task.state_type == StateType.RUNNING
                    and worker in done_by and run is not None and run.infrastructure_pid):
                os.killpg(stack.pids[worker], signal.SIGKILL)
                os.killpg(int(run.infrastructure_pid), signal.SIGKILL)
                return {"worker": worker, "flow_run": str(run.id), "task": task.name}
        time.sleep(0.5)
    raise AssertionError("no prune stage ran on a worker that had finished a variant")


def test_sweep_over_two_workers_survives_a_lost_worker(stack, tiny_demo, tmp_path):
    recipe = {
        "name": "dist", "model": str(tiny_demo),
        "calibration": {"samples": 8, "seq_len": 64},
        "eval": {"perplexity": {"seq_len": 64, "max_windows": 4}},
        "variants": [{"name": "base", "stages": []}],
        "sweep": {"prune": {"method": "frequency", "ratio": [0.25, 0.5]},
                  "quantize": {"method": "rtn", "bits": [3, 4], "group_size": 64}},
        "validate": {"enabled": False},
        "execution": {"retries": 2, "poll_seconds": 2},
    }
    path = tmp_path / "dist.yaml"
    path.write_text(yaml.safe_dump(recipe))
    store = tmp_path / "store"
    env = {**os.environ, **stack.env()}
    parent_proc = subprocess.Popen(
        [sys.executable, "-m", "thresher", "run", str(path), "--pool", stack.pool,
         "--store-dir", str(store), "--publish-dir", str(tmp_path / "published")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        start_new_session=True)
    try:
        with _client(stack) as client:
            killed = kill_a_worker_during_a_prune(client, stack, parent_proc, time.time() + 600)
        out, _ = parent_proc.communicate(timeout=900)
    finally:
        if parent_proc.poll() is None:
            os.killpg(parent_proc.pid, signal.SIGKILL)
    assert parent_proc.returncode == 0, out
    parent_id = re.search(r"parent run (\w+) at", out).group(1)

    # every variant is a finished nested run under the one parent, with metrics and artifacts
    ml = MlflowClient(stack.mlflow_url)
    parent = ml.get_run(parent_id)
    children = ml.search_runs([parent.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{parent_id}'")
    finished = {r.info.run_name: r for r in children if r.info.status == "FINISHED"}
    assert sorted(finished) == sorted(VARIANTS)
    for run in finished.values():
        assert run.info.artifact_uri.startswith("mlflow-artifacts:"), "artifacts are proxied"
        assert {"perplexity", "size_bytes", "compression_ratio"} <= set(run.data.metrics)
    for name in VARIANTS[1:]:
        files = {a.path for a in ml.list_artifacts(finished[name].info.run_id)}
        assert {"prune_report.json", "quantize_report.json"} <= files, (name, files)
    assert "comparison/report.html" in {
        a.path for a in ml.list_artifacts(parent_id, "comparison")}

    # the killed variant's run was closed as KILLED, and its retry finished
    killed_variant = killed["task"].split("/")[0]
    assert any(r.info.run_name == killed_variant and r.info.status == "KILLED" for r in children)

    # each shared prefix (a frequency prune) was computed once: its second child reused it
    for ratio in ("25", "50"):
        hits = sorted(finished[f"frequency{ratio}-rtn{b}"].data.metrics["prune.cache_hit"]
                      for b in (3, 4))
        assert hits == [0.0, 1.0], (ratio, hits)

    with _client(stack) as client:
        from prefect.client.schemas.objects import StateType

        workers = worker_of_flow_runs(client)
        lost = client.read_flow_run(killed["flow_run"])
        assert lost.state_type == StateType.CRASHED, lost.state
    # both workers ran variants that finished, per the Prefect API's record of submissions
    ran_on = {workers[r.data.tags[FLOW_RUN_TAG]] for r in finished.values()}
    assert ran_on == {"worker-1", "worker-2"}, ran_on
    assert killed["worker"] in ran_on
    assert Path(store).is_dir()
