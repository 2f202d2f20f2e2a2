"""Held-out perplexity after expert pruning: REAP against EAN, frequency and random.

Every method prunes the same model with statistics from one observation of the same calibration
windows (the random control observes nothing; it is averaged over seeds). Perplexity is
token-level on the stdlib held-out split.

    python benchmarks/prune_quality.py tiny small [--samples 128 --windows 64]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from thresher.data.demo_model import build_demo_model
from thresher.data.windows import calibration_windows
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.models import load_model, load_tokenizer
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.api import prune_model
from thresher.prune.observer import observe_experts
from thresher.recipe import CalibrationConfig, PerplexityConfig, PruneStage

METHODS = ("reap", "ean", "frequency")
RATIOS = (0.25, 0.5)


def measure(size: str, cal: CalibrationConfig, ppl_cfg: PerplexityConfig, seeds: int,
            work: Path) -> dict[str, str]:
    path = build_demo_model(size)
    tok = load_tokenizer(path)
    def ppl(model_dir: Path) -> float:
        return heldout_perplexity(load_model(model_dir), ppl_cfg, tokenizer=tok,
                                  show_progress=False).perplexity

    row = {"unpruned": f"{ppl(path):.2f}"}
    start = time.perf_counter()
    observed = observe_experts(LayerwiseModel(path), calibration_windows(tok, cal))
    row["observation seconds"] = f"{time.perf_counter() - start:.0f}"

    def pruned_ppl(stage: PruneStage) -> float:
        out = work / f"{size}-{stage.method}-{stage.ratio}-{stage.seed}"
        prune_model(path, stage, cal, out, observed=observed, show_progress=False)
        return ppl(out)

    for ratio in RATIOS:
        pct = f"{int(ratio * 100)}%"
        for method in METHODS:
            row[f"{method} {pct}"] = f"{pruned_ppl(PruneStage(method=method, ratio=ratio)):.2f}"
        rand = [pruned_ppl(PruneStage(method="random", ratio=ratio, seed=s)) for s in range(seeds)]
        row[f"random {pct}"] = (f"{statistics.mean(rand):.2f} ({min(rand):.0f}-{max(rand):.0f})"
                                if seeds > 1 else f"{rand[0]:.2f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", default=["tiny", "small"])
    parser.add_argument("--samples", type=int, default=128, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--windows", type=int, default=64, help="held-out windows scored")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the random control")
    args = parser.parse_args()
    torch.set_num_threads(2)
    cal = CalibrationConfig(samples=args.samples, seq_len=args.seq_len)
    ppl_cfg = PerplexityConfig(seq_len=args.seq_len, max_windows=args.windows)
    with tempfile.TemporaryDirectory() as work:
        columns = {size: measure(size, cal, ppl_cfg, args.seeds, Path(work)) for size in args.sizes}
    print(f"Held-out perplexity after pruning ({ppl_cfg.max_windows} windows of {args.seq_len} "
          f"tokens; calibration {args.samples} x {args.seq_len} stdlib train; random = mean "
          f"(range) of {args.seeds} seeds; {platform.machine()})\n")
    print("| | " + " | ".join(f"demo:{size}" for size in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label in next(iter(columns.values())):
        print(f"| {label} | " + " | ".join(col[label] for col in columns.values()) + " |")


if __name__ == "__main__":
    main()
