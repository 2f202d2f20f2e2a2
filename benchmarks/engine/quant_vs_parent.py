"""Each 4-bit variant's serving throughput against its 16-bit parent, interleaved in one run.

    PYTHONPATH=. python benchmarks/engine/quant_vs_parent.py --threads 1 --rounds 3

The variants are the demo recipe's (configs/demo.yaml) as `make demo` publishes them (``--store``,
default the thresher store's ``published/demo``): ``base`` (the `small` demo model itself) is the
parent of gptq4, awq4 and nf4, ``auto50`` of auto50-gptq4, -awq4 and -nf4. Every variant is served
by the engine under ``--dtypes`` (default ``auto``), the same held-out prompts x
N greedy tokens, EOS ignored, prefix caching off, at concurrency 1 and 16 (at most c requests in
flight, a new one joining as one finishes). Each round times every engine once per concurrency,
in turn, so that load changes on a shared machine hit parent and child alike; a 4-bit row's
ratio is the median over rounds of (its tok/s / its parent's tok/s in the same round). Beside the
wall-clock rate it reports the process CPU time per token: on a loaded machine a run waits for a
core longer than it computes, and with one thread the CPU time is the run's own work, so its
ratio (parent's CPU time / the variant's, above 1: the variant is cheaper) is the steadier one.

Each 4-bit variant runs twice: as the engine loads it by default (matrices at most
``cpu_dense.DENSE_MAX_ELEMENTS`` weights dequantized at load, which is every matrix of `small`)
and with ``THRESHER_CPU_DENSE_MAX=0`` (every matrix on its packed 4-bit kernel, the engine before
that threshold), so the table shows both in the same run.

``--dtypes float32 bfloat16`` serves every row in each dtype (labels end in the dtype); every
ratio is then against the parent in the first dtype named, so the table also says what the
serving dtype is worth (``--dtype auto``'s choice on a CPU).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from serving_loops import continuous  # beside this script

from thresher.data.demo_model import demo_model_dir
from thresher.data.windows import eval_windows
from thresher.models import load_tokenizer
from thresher.paths import state_dir
from thresher.recipe import PerplexityConfig
from thresher.serve_kernels import LLMEngine, SamplingParams
from thresher.serve_kernels.kernels import cpu_dense

PARENTS = {"base": ["gptq4", "awq4", "nf4"], "auto50": ["auto50-gptq4", "auto50-awq4", "auto50-nf4"]}
CONCURRENCY = (1, 16)


def load(path: Path, dtype: str, dense_max: str | None, max_len: int) -> LLMEngine:
    """An engine for ``path``, with ``THRESHER_CPU_DENSE_MAX`` set to ``dense_max`` while loading."""
    before = os.environ.pop(cpu_dense.ENV_VAR, None)
    if dense_max is not None:
        os.environ[cpu_dense.ENV_VAR] = dense_max
    try:
        return LLMEngine(path, dtype=dtype, max_num_seqs=max(CONCURRENCY), max_model_len=max_len,
                         enable_prefix_caching=False)
    finally:
        os.environ.pop(cpu_dense.ENV_VAR, None)
        if before is not None:
            os.environ[cpu_dense.ENV_VAR] = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=None,
                    help="directory holding the published demo variants")
    ap.add_argument("--base", type=Path, default=None, help="the parent of the unpruned variants")
    ap.add_argument("--dtypes", nargs="+", default=["auto"],
                    help="serving dtypes; ratios are against the parent in the first")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = args.store or state_dir() / "published" / "demo"
    paths = {"base": args.base or demo_model_dir("small")}
    paths.update({name: store / name for name in ("auto50", *sum(PARENTS.values(), []))})
    paths = {name: p for name, p in paths.items() if (p / "config.json").is_file()}
    tokenizer = load_tokenizer(paths["base"])
    windows = eval_windows(tokenizer, PerplexityConfig(seq_len=args.prompt_len,
                                                       max_windows=args.requests))
    prompts = windows.tolist()
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    total = len(prompts) * args.new_tokens

    # (label, parent label, dense_max override, dtype)
    rows: list[tuple[str, str, str | None, str]] = []
    tag = (lambda d: f" {d}") if len(args.dtypes) > 1 else (lambda d: "")
    for parent, children in PARENTS.items():
        if parent not in paths:
            continue
        first = parent + tag(args.dtypes[0])
        for d in args.dtypes:
            rows.append((parent + tag(d), first, None, d))
            for child in children:
                if child in paths:
                    rows += [(child + tag(d), first, None, d),
                             (f"{child} (packed kernels){tag(d)}", first, "0", d)]
    max_len = max(256, args.prompt_len + args.new_tokens)
    engines = {label: load(paths[label.split(" ")[0]], dtype, dense_max, max_len)
               for label, _, dense_max, dtype in rows}
    dtype = ", ".join(dict.fromkeys(e.model_info["dtype"] for e in engines.values()))
    print(f"torch {torch.__version__}, {args.threads} thread(s), {platform.machine()}, serving "
          f"dtype {dtype}, {len(prompts)} requests x {args.prompt_len} prompt tokens x "
          f"{args.new_tokens} greedy tokens, {args.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.1f} at the start", flush=True)

    tps: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}  # process CPU seconds per token
    for r in range(args.rounds):
        for c in CONCURRENCY:
            for label, *_ in rows:
                engine = engines[label]

                def submit(rid: str, prompt: list[int], engine=engine) -> None:
                    engine.add_request(rid, prompt, params)

                if r == 0 and c == 1:  # warm each engine up on two prompts
                    continuous(engine, submit, prompts[:2], c)
                start = time.process_time()
                wall, _ = continuous(engine, submit, prompts, c)
                cpu.setdefault((label, c), []).append((time.process_time() - start) / total)
                tps.setdefault((label, c), []).append(total / wall)
        print(f"round {r + 1} done, load average {os.getloadavg()[0]:.1f}", flush=True)

    head = " | ".join(f"c={c} tok/s | c={c} / parent | c={c} CPU ms/tok | c={c} CPU parent / it"
                      for c in CONCURRENCY)
    print(f"\n| variant | parent | {head} |")
    print("|---|---|" + "---|" * 4 * len(CONCURRENCY))
    for label, parent, *_ in rows:
        cells = []
        for c in CONCURRENCY:
            mine, theirs = tps[(label, c)], tps[(parent, c)]
            ratio = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
            work, parent_work = cpu[(label, c)], cpu[(parent, c)]
            cheaper = statistics.median(b / a for a, b in zip(work, parent_work, strict=True))
            cells.append(f"{statistics.median(mine):,.0f} | {ratio:.2f}x | "
                         f"{statistics.median(work) * 1e3:.2f} | {cheaper:.2f}x")
        print(f"| {label} | {parent} | {' | '.join(cells)} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
