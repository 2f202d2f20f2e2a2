"""Where one CPU decode step at batch 1 spends its time: operator counts, operator time, Python.

    PYTHONPATH=. python benchmarks/engine/decode_step_profile.py /tmp/m/model /tmp/m/gptq4 \
        --dtype bfloat16 --threads 2            # models from cpu_decode.py --workdir /tmp/m

For each model it prefills one prompt, then times ``engine.step()`` decode steps (median wall
time, and median process CPU time, which waiting for a core on a loaded machine does not add to;
with one thread it is the step's work), runs one step under ``torch.profiler`` (operators per
step and their self CPU time, the top ones by shape) and a few under cProfile (total wall time
per step with Python's profiling overhead). Operator counts do not
depend on the machine's load, so they compare two trees even on a busy machine; the times do.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from thresher.serve_kernels import SamplingParams
from thresher.serve_kernels.engine.llm_engine import LLMEngine

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 400, 12, 3, 250, 61, 8, 99, 150, 31]


def decoding_engine(path: Path, dtype: str, steps: int) -> LLMEngine:
    """An engine with one greedy request whose prompt is already prefilled."""
    engine = LLMEngine(path, dtype=dtype, max_num_seqs=1)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=steps,
                                                   ignore_eos=True))
    engine.step()  # prefill + first token
    return engine


def measure(path: Path, dtype: str, steps: int, top: int) -> None:
    engine = decoding_engine(path, dtype, 3 * steps + 16)
    for _ in range(3):
        engine.step()  # warm up
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    step_ms, cpu_ms = statistics.median(times) * 1e3, statistics.median(cpu) * 1e3
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.step()
    events = prof.key_averages()
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    self_ms = sum(e.self_cpu_time_total for e in events) / 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    py_ms = stats.total_tt / steps * 1e3  # type: ignore[attr-defined]
    print(f"\n{path.name} ({dtype}): median step {step_ms:.1f} ms ({1e3 / step_ms:.1f} tok/s), "
          f"process CPU time {cpu_ms:.1f} ms, {calls} aten calls per step, profiled op self time "
          f"{self_ms:.1f} ms, cProfile step {py_ms:.1f} ms")
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40,
        max_shapes_column_width=60))
    counts = sorted(((e.count, e.key) for e in events if e.key.startswith("aten::")),
                    reverse=True)
    print("calls per step: " + ", ".join(f"{k.removeprefix('aten::')} {n}" for n, k in counts[:25]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    for path in args.models:
        measure(path, args.dtype, args.steps, args.top)


if __name__ == "__main__":
    main()
