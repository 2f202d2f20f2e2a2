"""Train the demo models from scratch and report training time and held-out perplexity.

    .venv/bin/python benchmarks/quality/demo_models.py [tiny small]
    .venv/bin/python benchmarks/quality/demo_models.py small --seed 1 --out /tmp/small-seed1

Retrains (``force``) so the time is a real measurement, not a cache hit; prints a markdown table
for docs/benchmarks.md. ``--seed`` trains another training seed of the same recipe into
``--out`` (the directory other benchmarks take as ``--model``), for orderings that must hold
across training runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from thresher.data.demo_model import SPECS, build_demo_model, build_from_spec
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.formats.artifact import DEMO_MODEL_META
from thresher.recipe import PerplexityConfig


def main(sizes: list[str], seed: int | None, out: Path | None) -> None:
    rows = []
    for size in sizes:
        spec = SPECS[size] if seed is None else dataclasses.replace(SPECS[size], seed=seed)
        start = time.perf_counter()
        if seed is None:
            path = build_demo_model(size, force=True)
        else:
            path = build_from_spec(spec, out / size if len(sizes) > 1 else out, force=True,
                                   label=f"demo:{size} seed {seed}")
        wall = time.perf_counter() - start
        meta = json.loads((path / DEMO_MODEL_META).read_text())
        ppl = heldout_perplexity(path, PerplexityConfig(seq_len=256, max_windows=64),
                                 show_progress=False)
        rows.append(
            f"| {size} | {meta['parameters']:,} | {spec.hidden_size} | {spec.steps} x "
            f"{spec.batch_size}x{spec.seq_len} | {wall:.0f} s | {meta['train_seconds']:.0f} s | "
            f"{ppl.perplexity:.2f} | {ppl.tokens:,} |"
        )
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print("| size | parameters | hidden | steps x batch | wall (build) | train (incl. tokenizer) "
          "| held-out ppl | tokens scored |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("sizes", nargs="*", help=f"of {', '.join(SPECS)} (default all)")
    parser.add_argument("--seed", type=int, default=None,
                        help="train this training seed of the recipe instead (needs --out)")
    parser.add_argument("--out", type=Path, default=None, help="where a --seed model goes")
    args = parser.parse_args()
    if unknown := [s for s in args.sizes if s not in SPECS]:
        parser.error(f"unknown sizes {unknown}; choose from {', '.join(SPECS)}")
    if args.seed is not None and args.out is None:
        parser.error("--seed needs --out (the demo cache holds the recipe's own seed only)")
    main(args.sizes or list(SPECS), args.seed, args.out)
