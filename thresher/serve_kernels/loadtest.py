"""A load test over HTTP: N concurrent streaming clients against an OpenAI-compatible server.

Each client sends its requests one after another (``stream: true``, greedy, ``ignore_eos`` so every
request generates exactly ``max_tokens``). Time to first token is measured at the client, from
sending the request to the first streamed token; time per output token is the rest of the stream
divided by the tokens after the first. Throughput is all generated tokens over the wall time.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class LoadResult:
    concurrency: int
    requests: int
    output_tokens: int
    wall_seconds: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Throughput and latency percentiles (ms), as flat numbers."""

        def pct(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q) * 1000) if xs else float("nan")

        return {
            "throughput_tok_s": self.output_tokens / self.wall_seconds,
            "requests_per_s": self.requests / self.wall_seconds,
            "ttft_p50_ms": pct(self.ttft_s, 50), "ttft_p99_ms": pct(self.ttft_s, 99),
            "tpot_p50_ms": pct(self.tpot_s, 50), "tpot_p99_ms": pct(self.tpot_s, 99),
        }


async def _one(client: httpx.AsyncClient, model: str, prompt: str,
               max_tokens: int) -> tuple[float, float | None, int]:
    """(TTFT, TPOT or None, generated tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"load test request failed: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event["choices"]:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if first is None:
        raise RuntimeError("load test request streamed no tokens")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return first - start, tpot, tokens


async def _run(url: str, model: str, prompts: list[str], concurrency: int, requests: int,
               max_tokens: int, api_key: str | None) -> LoadResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    result = LoadResult(concurrency, requests, 0, 0.0)
    todo = iter(range(requests))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in todo:
            ttft, tpot, tokens = await _one(client, model, prompts[i % len(prompts)], max_tokens)
            result.ttft_s.append(ttft)
            if tpot is not None:
                result.tpot_s.append(tpot)
            result.output_tokens += tokens

    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        result.wall_seconds = time.perf_counter() - start
    return result


def load_test(url: str, model: str, prompts: list[str], concurrency: int, requests: int,
              max_tokens: int, api_key: str | None = None) -> LoadResult:
    """Send ``requests`` streamed completions from ``concurrency`` clients; measure the service."""
    if concurrency < 1 or requests < 1:
        raise ValueError("concurrency and requests must be positive")
    run = _run(url, model, prompts, concurrency, requests, max_tokens, api_key)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run)
    with ThreadPoolExecutor(1) as pool:  # called from async code: run on a loop of its own
        return pool.submit(asyncio.run, run).result()
