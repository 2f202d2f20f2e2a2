"""Train the demo models from scratch and report training time and held-out perplexity.

    .venv/bin/python benchmarks/demo_models.py [tiny small]

Retrains (``force``) so the time is a real measurement, not a cache hit; prints a markdown table
for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch

from thresher.data.demo_model import SPECS, build_demo_model
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.formats.artifact import DEMO_MODEL_META
from thresher.recipe import PerplexityConfig


def main(sizes: list[str]) -> None:
    rows = []
    for size in sizes:
        start = time.perf_counter()
        path = build_demo_model(size, force=True)
        wall = time.perf_counter() - start
        meta = json.loads((path / DEMO_MODEL_META).read_text())
        ppl = heldout_perplexity(path, PerplexityConfig(seq_len=256, max_windows=64),
                                 show_progress=False)
        spec = SPECS[size]
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
    main(sys.argv[1:] or list(SPECS))
