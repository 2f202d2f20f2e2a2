"""AWQ against RTN and clip against scale-only, paired over the same held-out windows.

    python benchmarks/quality/awq_paired.py --model demo:tiny --group-size 64 --windows 128
    python benchmarks/quality/awq_paired.py --model demo:small --group-size 128 --windows 128 \
        --cache /tmp/awq-small.json

A few tenths of a percent of perplexity on a 1-5 M parameter model can be noise, so every pair
is compared window by window: the per-window mean-NLL difference, a 95% paired bootstrap interval
over windows (fixed seed) and the windows the first of the pair scores better; a star marks an
interval that excludes zero. Consecutive windows come from the same source files, so a second
interval resamples blocks of ``--block`` consecutive windows. Both intervals are over held-out
windows for the artifacts at hand; ``--cal-seed`` draws other calibration windows, the other
source of spread. Each row's per-window NLLs are kept in ``--cache`` (JSON), so rows can be run
by separate processes (``--rows``) and the comparisons printed from the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from thresher.compress.api import quantize_model
from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import window_nlls
from thresher.evaluate.significance import paired_perplexity
from thresher.models import load_model, load_tokenizer, resolve_model
from thresher.models.quantized import load_quantized_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage

ROWS = {  # label -> (method, options)
    "rtn": ("rtn", {}),
    "awq": ("awq", {}),
    "awq scale-only": ("awq", {"clip": False}),
    "awq heldout": ("awq", {"select_on": "heldout"}),
    "awq heldout scale-only": ("awq", {"select_on": "heldout", "clip": False}),
}
PAIRS = [  # (variant, base): the claim is that the variant is better
    ("awq", "rtn"),
    ("awq", "awq scale-only"),
    ("awq heldout", "rtn"),
    ("awq heldout scale-only", "awq scale-only"),
    ("awq heldout scale-only", "rtn"),
    ("awq heldout", "awq"),
    ("awq heldout", "awq heldout scale-only"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:tiny")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--cal-seed", type=int, default=0,
                    help="calibration sample seed: another draw of the calibration windows")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--cache", type=Path, help="JSON of per-window NLLs, read and extended")
    ap.add_argument("--block", type=int, default=8,
                    help="second interval: resample runs of this many consecutive windows")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    windows = eval_windows(tok, PerplexityConfig(max_windows=args.windows))
    cal = CalibrationConfig(samples=args.samples, seed=args.cal_seed)
    key = (f"{args.model} {args.bits}-bit g{args.group_size} cal {args.samples} x 256"
           f" seed {args.cal_seed}")
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    rows = cache.setdefault(key, {})

    def save() -> None:
        if args.cache:
            args.cache.write_text(json.dumps(cache))

    if "float" not in rows or len(rows["float"]["nll"]) != len(windows):
        rows["float"] = {"nll": window_nlls(load_model(path), windows,
                                            show_progress=False).tolist(), "seconds": 0.0}
        save()
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.rows:
            if label in rows and len(rows[label]["nll"]) == len(windows):
                continue
            method, extra = ROWS[label]
            stage = QuantizeStage(method=method, bits=args.bits, group_size=args.group_size,
                                  **extra)
            out = Path(tmp) / label.replace(" ", "-")
            start = time.perf_counter()
            quantize_model(path, stage, cal, out, show_progress=False)
            seconds = time.perf_counter() - start
            nll = window_nlls(load_quantized_model(out), windows, show_progress=False)
            rows[label] = {"nll": nll.tolist(), "seconds": seconds}
            save()
            print(f"{label}: {seconds:.0f} s", flush=True)
    fp = math.exp(sum(rows["float"]["nll"]) / len(windows))
    print(f"\nmodel {key}, {len(windows)} held-out windows of 256, float {fp:.3f}\n")
    print("| row | perplexity | vs float | quantize s |")
    print("|---|---|---|---|")
    for label in ROWS:
        if label in rows:
            p = math.exp(sum(rows[label]["nll"]) / len(windows))
            print(f"| {label} | {p:.3f} | {100 * (p / fp - 1):+.3f}% | "
                  f"{rows[label]['seconds']:.0f} |")
    print(f"\n| variant vs base | perplexity change [95% paired CI], windows better | "
          f"CI over blocks of {args.block} windows |")
    print("|---|---|---|")
    for variant, base in PAIRS:
        if variant in rows and base in rows:
            d = paired_perplexity(rows[base]["nll"], rows[variant]["nll"], block=1)
            b = paired_perplexity(rows[base]["nll"], rows[variant]["nll"], block=args.block)
            print(f"| {variant} vs {base} | {d.describe()} | "
                  f"{b.describe().rsplit(',', 1)[0].split(' ', 1)[1]} |")


if __name__ == "__main__":
    main()
