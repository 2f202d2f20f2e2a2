"""A real Prefect server for the flow tests, and helpers to run thresher as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Wait until ``url``/health answers 200; fail with the server's log if it dies or stalls."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, log.read_text()
        time.sleep(0.5)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free loopback port with its own database; yields the API URL."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_UI_API_URL": url}
    with open(home / "server.log", "w") as log:
        yield from _serve(home, port, url, env, log)


def _serve(home: Path, port: int, url: str, env: dict, log):
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
         "--port", str(port), "--no-ui"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError((home / "server.log").read_text())
        time.sleep(1)
    else:
        proc.kill()
        raise RuntimeError("prefect server did not start:\n" + (home / "server.log").read_text())
    yield {"url": url, "home": str(home), "env": env}
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture()
def prefect_api(prefect_server):
    """In-process flows talk to the session's server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        yield prefect_server["url"]


def thresher_cmd(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "thresher"), *args]
