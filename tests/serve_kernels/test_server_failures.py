"""The server when the engine loop fails: every waiting request gets 503, none hangs, /health
says so at once, and the serving process ends with a non-zero status for its supervisor."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.flows.conftest import free_port
from thresher.serve_kernels import LLMEngine
from thresher.serve_kernels.server import (
    ENGINE_FAILED_EXIT,
    BackgroundServer,
    ServerConfig,
    build_app,
    run_server,
)


class FailingEngine:
    """An ``LLMEngine`` whose next step, once ``arm``ed, blocks until ``release`` and then raises."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.armed, self.stepping, self.release = (threading.Event(), threading.Event(),
                                                   threading.Event())

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        if self.armed.is_set():
            self.stepping.set()
            self.release.wait(timeout=30)
            raise RuntimeError("injected engine failure")
        return self._engine.step()


@pytest.fixture
def failing(tiny_demo):
    engine = FailingEngine(LLMEngine(tiny_demo, max_num_seqs=4, max_model_len=256))
    app = build_app(engine, ServerConfig(served_model_name="tiny", max_num_seqs=4, max_queue=4))
    with BackgroundServer(app) as srv:
        yield engine, app.state.async_engine, srv.url


def test_engine_failure_answers_running_and_pending_requests_with_503(failing):
    engine, aengine, url = failing
    body = {"prompt": "def main():", "max_tokens": 16}
    engine.armed.set()
    with httpx.Client(base_url=url, timeout=10) as client, ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.post, "/v1/completions", json=body)
        assert engine.stepping.wait(timeout=10)  # the loop is inside the step that will fail
        pending = pool.submit(client.post, "/v1/completions", json=body)
        deadline = time.monotonic() + 10
        while aengine.in_flight < 2:  # the second waits for an admission the loop never gives
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine.release.set()
        for future in (running, pending):
            response = future.result(timeout=10)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_unavailable"
            assert "injected" not in response.text  # the exception goes to the log only
        assert client.post("/v1/completions", json=body).status_code == 503
        assert client.get("/health").status_code == 503


def test_serving_ends_with_a_failure_status_after_answering_the_waiters(tiny_demo):
    engine = FailingEngine(LLMEngine(tiny_demo, max_num_seqs=4, max_model_len=256))
    app = build_app(engine, ServerConfig(served_model_name="tiny", max_num_seqs=4, max_queue=4))
    port = free_port()
    status: list[int] = []
    serving = threading.Thread(target=lambda: status.append(run_server(app, "127.0.0.1", port)))
    serving.start()
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=10) as client, ThreadPoolExecutor(1) as pool:
        deadline = time.monotonic() + 30
        while True:  # until it listens
            try:
                assert client.get("/health").status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        engine.armed.set()
        waiter = pool.submit(client.post, "/v1/completions",
                             json={"prompt": "def main():", "max_tokens": 16})
        assert engine.stepping.wait(timeout=10)
        assert client.get("/health").status_code == 200  # not failed yet: still stepping
        engine.release.set()
        assert waiter.result(timeout=10).status_code == 503
    serving.join(timeout=30)
    assert not serving.is_alive() and status == [ENGINE_FAILED_EXIT]
