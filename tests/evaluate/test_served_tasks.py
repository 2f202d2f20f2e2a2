"""A generative built-in task through `thresher serve` with lm-eval's own `local-completions`
client scores the same as in-process: the served engine is the engine the evaluation uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows.conftest import free_port, wait_healthy
from thresher.evaluate.builtin_tasks import prepare_builtin_tasks
from thresher.evaluate.tasks import run_tasks

ROOT = Path(__file__).resolve().parents[2]
TASK = "stdlib_complete_line"
LIMIT = 24

pytestmark = pytest.mark.slow


def test_served_task_scores_as_in_process(tiny_demo, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "THRESHER_API_KEY"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "thresher", "serve", str(tiny_demo), "--port", str(port),
             "--served-model-name", "tiny", "--dtype", "float32"],  # run_tasks' dtype
            env={**env, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log, timeout=180)
        manager = TaskManager(include_path=str(prepare_builtin_tasks()), include_defaults=False)
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{url}/v1/completions", "model": "tiny",
                        "tokenizer_backend": "none", "tokenized_requests": False,
                        "num_concurrent": 4, "max_retries": 1},
            tasks=[TASK], task_manager=manager, limit=LIMIT, log_samples=True)
    finally:
        proc.terminate()
        proc.wait(30)
    local = run_tasks(tiny_demo, tasks=[TASK], limit=LIMIT, show_progress=False)
    rows = sorted(served["samples"][TASK], key=lambda r: r["doc_id"])
    for metric in ("exact_match", "char_similarity"):
        assert [r[metric] for r in rows] == list(local.per_sample[f"{TASK}/{metric}"].values())
        assert served["results"][TASK][f"{metric},none"] == pytest.approx(
            local.scores[TASK][metric].value)
    assert local.scores[TASK]["char_similarity"].value > 0.1  # real text, not empty strings
