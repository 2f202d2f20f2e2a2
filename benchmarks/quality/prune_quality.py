"""Held-out perplexity after expert pruning: every criterion, auto, and damage budgets.

The single criteria (REAP, EAN, frequency, weighted EAN) prune the same model with statistics
from one observation of all calibration windows; ``auto`` and damage budgets share a second
observation that holds the last quarter of those windows out for local errors (the random control
observes nothing; it is averaged over seeds). ``auto`` and ``auto damage`` minimize the local
error, ``auto loss`` and ``auto damage loss`` the end-to-end loss increase on those held-out
windows (``damage: loss``), ``sequential`` measured with the earlier layers already pruned.
``--refit`` adds, for every row but the random control, the same pruning with the kept experts'
down projections refit (``refit: true``, each ``--refit-damp`` and ``--refit-target``).
Perplexity is token-level on the stdlib held-out split; each cell shows the increase over the
unpruned model. A model is a demo size or a checkpoint directory (other training seeds of a demo
recipe). ``--tune`` scores the tuning windows (``data.windows.tune_windows``) instead of the
evaluation windows: choose a default (the refit's target and damping) with it, report without.

    python benchmarks/quality/prune_quality.py tiny small /tmp/small-seed1 [--samples 128 --windows 64]
    python benchmarks/quality/prune_quality.py small --samples 64 --probed auto "auto damage" --refit
"""

from __future__ import annotations

import argparse
import os
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
from thresher.prune.api import observe_for, prune_model
from thresher.prune.observer import observe_experts
from thresher.prune.plan import needs_probes
from thresher.recipe import CalibrationConfig, PerplexityConfig, PruneStage

METHODS = ("reap", "ean", "frequency", "weighted_ean")
PROBED = {"auto": {"method": "auto"}, "auto damage": {"method": "auto", "budget": "damage"},
          "auto loss": {"method": "auto", "damage": "loss"},
          "auto damage loss": {"method": "auto", "budget": "damage", "damage": "loss"},
          "auto damage loss sequential": {"method": "auto", "budget": "damage", "damage": "loss",
                                          "sequential": True}}
RATIOS = (0.25, 0.5)


def measure(size: str, cal: CalibrationConfig, ppl_cfg: PerplexityConfig, seeds: int,
            work: Path, rows: tuple[str, ...] = tuple(PROBED),
            refits: tuple[tuple[float, str], ...] = (), split: str = "eval") -> dict[str, str]:
    path = Path(size) if "/" in size else build_demo_model(size)
    tok = load_tokenizer(path)
    def ppl(model_dir: Path) -> float:
        return heldout_perplexity(load_model(model_dir), ppl_cfg, tokenizer=tok,
                                  show_progress=False, split=split).perplexity

    base = ppl(path)
    row = {"unpruned": f"{base:.2f}"}
    windows = calibration_windows(tok, cal)
    start = time.perf_counter()
    observed = observe_experts(LayerwiseModel(path), windows)
    row["observation seconds"] = f"{time.perf_counter() - start:.0f}"
    start = time.perf_counter()
    probed = observe_for(PruneStage(method="auto", ratio=0.5), LayerwiseModel(path), windows)
    row["observation with probes seconds"] = f"{time.perf_counter() - start:.0f}"

    def cell(value: float) -> str:
        return f"{value:.2f} ({100 * (value / base - 1):+.1f}%)"

    def pruned_ppl(stage: PruneStage, name: str) -> float:
        out = work / f"{path.name}-{name}-{stage.ratio}-{stage.seed}".replace(" ", "-")
        start = time.perf_counter()
        report = prune_model(path, stage, cal, out, observed=probed if needs_probes(stage)
                             else observed, show_progress=False)
        plan_seconds[name] = time.perf_counter() - start
        if needs_probes(stage) and not stage.refit:
            row[f"{name} {int(stage.ratio * 100)}% layers"] = " ".join(
                f"{r.criterion}:{len(r.kept)}" for r in report.layers)
        return ppl(out)

    plan_seconds: dict[str, float] = {}
    for ratio in RATIOS:
        pct = f"{int(ratio * 100)}%"
        variants = [(m, {"method": m}) for m in METHODS] + [(n, PROBED[n]) for n in rows]
        for name, options in variants:
            row[f"{name} {pct}"] = cell(pruned_ppl(PruneStage(ratio=ratio, **options), name))
            for damp, target in refits:
                label = f"{name} refit" + (f" {target}" if len({t for _, t in refits}) > 1
                                           else "") + (
                    f" {damp:g}" if len({d for d, _ in refits}) > 1 else "")
                row[f"{label} {pct}"] = cell(pruned_ppl(PruneStage(
                    ratio=ratio, refit=True, refit_damp=damp, refit_target=target, **options),
                    label))
        rand = [pruned_ppl(PruneStage(method="random", ratio=ratio, seed=s), "random")
                for s in range(seeds)]
        row[f"random {pct}"] = (f"{statistics.mean(rand):.2f} ({min(rand):.0f}-{max(rand):.0f})"
                                if seeds > 1 else cell(rand[0]))
    row["prune seconds (reap / " + " / ".join(rows) + ")"] = " / ".join(
        f"{plan_seconds[name]:.0f}" for name in ("reap", *rows))
    print(f"{size}: " + "; ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    return row


def print_columns(columns: dict[str, dict[str, str]]) -> None:
    """One markdown table: a row per label, a column per model (damage_quantized.py too)."""
    print("| | " + " | ".join(size if "/" in size else f"demo:{size}" for size in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label in next(iter(columns.values())):
        print(f"| {label} | " + " | ".join(col[label] for col in columns.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", default=["tiny", "small"],
                        help="demo sizes or checkpoint directories")
    parser.add_argument("--samples", type=int, default=128, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--windows", type=int, default=64, help="held-out windows scored")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the random control")
    parser.add_argument("--probed", nargs="+", choices=tuple(PROBED), default=tuple(PROBED),
                        help="the auto / damage-budget rows to measure (default: all)")
    parser.add_argument("--refit", action="store_true",
                        help="also measure every row with the kept experts' down projections refit")
    parser.add_argument("--refit-damp", type=float, nargs="+", default=[0.01],
                        help="the refit's ridge strength(s) (with --refit)")
    parser.add_argument("--refit-target", nargs="+", choices=("block", "model"),
                        default=["model"], help="the refit's target(s) (with --refit)")
    parser.add_argument("--tune", action="store_true",
                        help="score the tuning windows, not the evaluation ones (choosing a default)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    cal = CalibrationConfig(samples=args.samples, seq_len=args.seq_len)
    ppl_cfg = PerplexityConfig(seq_len=args.seq_len, max_windows=args.windows)
    with tempfile.TemporaryDirectory() as work:
        refits = tuple((d, t) for t in args.refit_target for d in args.refit_damp
                       ) if args.refit else ()
        columns = {size: measure(size, cal, ppl_cfg, args.seeds, Path(work),
                                 tuple(args.probed), refits, "tune" if args.tune else "eval")
                   for size in args.sizes}
    print(f"Held-out perplexity after pruning ({ppl_cfg.max_windows} "
          f"{'tuning' if args.tune else 'evaluation'} windows of {args.seq_len} "
          f"tokens; calibration {args.samples} x {args.seq_len} stdlib train; random = mean "
          f"(range) of {args.seeds} seeds; {platform.machine()})\n")
    print_columns(columns)


if __name__ == "__main__":
    main()
