"""Whether a damage budget's pruning gain survives quantization (GPTQ-4, AWQ-4, NF4).

``auto`` at one ratio with a uniform and a damage budget, each then quantized (GPTQ-4, AWQ-4, NF4), scored on the same held-out windows
through thresher's loader, and the damage-budget GPTQ-4 artifact also through the serving engine
(prompt log-probabilities; per-layer expert counts load there too).

    OMP_NUM_THREADS=1 python benchmarks/quality/damage_quantized.py tiny small [--ratio 0.5] [--refit]

Each cell shows perplexity and the increase over the unpruned 16-bit model.
"""

from __future__ import annotations

import argparse
import math
import platform
import tempfile
import time
from pathlib import Path

import torch
from prune_quality import print_columns

from thresher.compress.api import quantize_model
from thresher.data.demo_model import build_demo_model
from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity
from thresher.models import load_model, load_tokenizer
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, PruneStage, QuantizeStage
from thresher.serve_kernels import LLM

QUANT = {"gptq-4": {"method": "gptq", "act_order": True}, "awq-4": {"method": "awq"},
         "nf4": {"method": "nf4"}}


def engine_perplexity(path: Path, windows: torch.Tensor) -> float:
    """Token-level perplexity from the engine's prompt log-probabilities of every window."""
    scores = LLM(path, dtype="float32", max_model_len=windows.shape[1]).score(windows.tolist())
    nll = [-lp for s in scores for lp in s[1:]]
    return math.exp(sum(nll) / len(nll))


def measure(size: str, ratio: float, group: int, cal: CalibrationConfig, ppl_cfg: PerplexityConfig,
            work: Path, refit: bool = False) -> dict[str, str]:
    path = Path(size) if "/" in size else build_demo_model(size)
    windows = eval_windows(load_tokenizer(path), ppl_cfg)

    def ppl(model_dir: Path) -> float:
        return perplexity(load_model(model_dir), windows, show_progress=False).perplexity

    base = ppl(path)
    row = {"unpruned 16-bit": f"{base:.2f}"}

    def cell(value: float) -> str:
        return f"{value:.2f} ({100 * (value / base - 1):+.1f}%)"

    for budget in ("uniform", "damage"):
        pruned = work / f"{path.name}-{budget}"
        start = time.perf_counter()
        prune_stage = PruneStage(method="auto", ratio=ratio, budget=budget, refit=refit)
        report = prune_model(path, prune_stage, cal, pruned, show_progress=False)
        row[f"{budget}: experts per layer"] = " ".join(str(len(r.kept)) for r in report.layers)
        row[f"{budget}: prune seconds"] = f"{time.perf_counter() - start:.0f}"
        row[f"{budget} 16-bit"] = cell(ppl(pruned))
        for name, options in QUANT.items():
            out = work / f"{path.name}-{budget}-{name}"
            stage = QuantizeStage(group_size=group, **options)
            quantize_model(pruned, stage, cal, out, show_progress=False)
            row[f"{budget} {name}"] = cell(ppl(out))
            if budget == "damage" and name == "gptq-4":
                row["damage gptq-4, serving engine"] = cell(engine_perplexity(out, windows))
        print(f"{size} {budget}: " + "; ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", default=["tiny", "small"],
                        help="demo sizes or checkpoint directories")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=128, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--windows", type=int, default=64, help="held-out windows scored")
    parser.add_argument("--refit", action="store_true",
                        help="refit the kept experts' down projections (as the demo recipe does)")
    args = parser.parse_args()
    cal = CalibrationConfig(samples=args.samples, seq_len=args.seq_len)
    ppl_cfg = PerplexityConfig(seq_len=args.seq_len, max_windows=args.windows)
    with tempfile.TemporaryDirectory() as work:
        columns = {size: measure(size, args.ratio, args.group_size, cal, ppl_cfg, Path(work),
                                 args.refit) for size in args.sizes}
    print(f"\nHeld-out perplexity, auto {int(args.ratio * 100)}%{' with the refit' * args.refit} "
          f"then 4-bit g{args.group_size} "
          f"({ppl_cfg.max_windows} windows of {args.seq_len} tokens; calibration {args.samples} x "
          f"{args.seq_len} stdlib train; {platform.machine()})\n")
    print_columns(columns)


if __name__ == "__main__":
    main()
