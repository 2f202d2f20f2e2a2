"""`thresher serve` as a user runs it: a subprocess on a loopback port, with an API key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.flows.conftest import free_port, wait_healthy
from thresher.models.inspect import weight_bytes
from thresher.serve_kernels.engine.llm_engine import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_serve_command(tiny_demo, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "THRESHER_API_KEY": "k3y"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "thresher", "serve", str(tiny_demo), "--port", str(port),
             "--served-model-name", "tiny", "--max-num-seqs", "4", "--num-kv-blocks", "200",
             "--block-size", "8", "--max-num-batched-tokens", "256"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log, timeout=120)
        startup = log.read_text()
        assert "loaded tiny:" in startup and "8 experts" in startup and "MiB" in startup, startup
        auto = resolve_dtype("auto", torch.device("cpu"), weight_bytes(tiny_demo))
        assert f"serving {auto}" in startup, startup  # --dtype auto on a CPU
        assert f"http://127.0.0.1:{port}/v1" in startup
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "import ", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 401
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k3y"},
                       json={"model": "tiny", "prompt": "import ", "max_tokens": 3,
                             "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        info = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k3y"}).json()
        assert (info["data"][0]["kv_blocks"], info["data"][0]["block_size"]) == (200, 8), info
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_refuses_a_kv_cache_too_small(tiny_demo):
    from typer.testing import CliRunner

    from thresher.cli import app

    result = CliRunner().invoke(app, ["serve", str(tiny_demo), "--num-kv-blocks", "2"])
    assert result.exit_code == 2
    assert "num_kv_blocks=2 cannot hold one sequence" in " ".join(result.output.split())


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_refuses_an_empty_api_key_before_loading(how):
    from typer.testing import CliRunner

    from thresher.cli import app

    args, env = ["serve", "/nonexistent-model"], {}
    if how == "flag":
        args += ["--api-key", ""]
    else:
        env["THRESHER_API_KEY"] = ""
    result = CliRunner().invoke(app, args, env=env)
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "the API key is empty" in output, output
    assert "not a model directory" not in output  # refused before touching the model


def test_serve_warns_on_a_non_loopback_bind_without_a_key(tiny_demo):
    from typer.testing import CliRunner

    from thresher.cli import app

    result = CliRunner().invoke(app, ["serve", str(tiny_demo), "--host", "0.0.0.0",
                                      "--num-kv-blocks", "2"], env={"THRESHER_API_KEY": None})
    output = " ".join(result.output.split())
    assert "warning: serving on 0.0.0.0 without an API key" in output, output
    assert result.exit_code == 2  # then the tiny KV cache stops it before it binds
