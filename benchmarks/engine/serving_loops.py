"""The request loops (fixed concurrency, Poisson arrivals) the serving benchmarks drive engines with.

Shared by thresher's engine (benchmarks/engine/engine_throughput.py) and vLLM's
(benchmarks/peers/vllm_worker.py, in its own venv); not a benchmark itself.

Both engines expose ``step()`` (outputs with ``request_id`` and ``finished``) and
``has_unfinished_requests()``; they differ in how a request is added and where an output's
tokens are, so the caller passes ``submit(request_id, prompt)`` and ``generated(output)``.
Imports nothing beyond the standard library, so either venv can use it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

Submit = Callable[[str, list[int]], None]


def continuous(engine: Any, submit: Submit, prompts: list[list[int]], concurrency: int
               ) -> tuple[float, list[float]]:
    """Wall time and per-request latencies with at most ``concurrency`` requests in flight, a new
    one joining as one finishes."""
    pending = list(enumerate(prompts))
    started: dict[str, float] = {}
    latencies = []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(started) < concurrency:
            i, p = pending.pop(0)
            rid = f"c{concurrency}-{i}"
            submit(rid, p)
            started[rid] = time.perf_counter()
        for out in engine.step():
            if out.finished:
                latencies.append(time.perf_counter() - started.pop(out.request_id))
    return time.perf_counter() - t0, latencies


def poisson(engine: Any, submit: Submit, generated: Callable[[Any], int],
            prompts: list[list[int]], rate: float, seed: int = 0
            ) -> tuple[list[float], list[float]]:
    """TTFT and TPOT (seconds) of each request when requests arrive as a Poisson process."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        arrivals.append(t)
    pending = list(zip(arrivals, range(len(prompts)), strict=True))
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    ttft, tpot = [], []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, i = pending.pop(0)
            submit(f"p{i}", prompts[i])
            arrived[f"p{i}"] = at
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            now = time.perf_counter() - t0
            rid = out.request_id
            if rid not in first and generated(out):
                first[rid] = now
                ttft.append(now - arrived[rid])
            if out.finished:
                tpot.append((now - first[rid]) / max(1, generated(out) - 1))
    return ttft, tpot
