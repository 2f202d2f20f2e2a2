"""Pruning against merging on a demo model, across training seeds, with paired intervals.

    python benchmarks/quality/prune_merge_compare.py --model demo:fine --seeds 0 1 2
        [--ratios 0.25 0.5] [--rows reap frequency m_smoe ...] [--samples 64] [--windows 128]
        [--block 8] [--gen-limit 64] [--cache prune_merge.json]

For every training seed of the demo recipe (seed 0 is the cached demo model; other seeds are
trained once and cached beside it under the same key scheme), every ratio and every row (REAP,
EAN, frequency, ``auto`` with a uniform and a damage budget, each with and without the refit, and
the two merging baselines), the variant is built by thresher's own stages and compared with its
base on the same held-out windows (per-window mean NLL: the perplexity change with a 95% paired
bootstrap interval over windows and one over blocks of ``--block`` neighbouring windows) and on
the same generative-task prompts (greedy, through the serving engine: the primary score's change
with its paired interval). A star marks an interval that excludes zero. The last tables give, per
ratio, the share of seeds on which each of the REAP paper's orderings holds, and each row's drop
as a fraction of uniform REAP's (the goal for the best recipe: at most 0.5 on every seed).
Results go to ``--cache`` (JSON) as they are measured, so a run that stops resumes there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from thresher.data.demo_model import SPECS, build_from_spec, demo_key
from thresher.data.windows import eval_windows
from thresher.evaluate.builtin_tasks import GENERATIVE
from thresher.evaluate.perplexity import window_nlls
from thresher.evaluate.significance import paired_difference, paired_documents, paired_perplexity
from thresher.evaluate.tasks import run_tasks
from thresher.models import load_model, load_tokenizer
from thresher.paths import demo_models_dir
from thresher.prune.api import prune_model
from thresher.prune.merge_api import merge_model
from thresher.recipe import CalibrationConfig, MergeStage, PerplexityConfig, PruneStage

ROWS: dict[str, tuple[type, dict]] = {
    "reap": (PruneStage, {"method": "reap"}),
    "ean": (PruneStage, {"method": "ean"}),
    "frequency": (PruneStage, {"method": "frequency"}),
    "auto": (PruneStage, {"method": "auto"}),
    "auto damage": (PruneStage, {"method": "auto", "budget": "damage"}),
    **{f"{name} refit": (PruneStage, {"method": m, "refit": True, **extra})
       for name, m, extra in (("reap", "reap", {}), ("ean", "ean", {}),
                              ("frequency", "frequency", {}), ("auto", "auto", {}),
                              ("auto damage", "auto", {"budget": "damage"}))},
    "m_smoe": (MergeStage, {"method": "m_smoe"}),
    "hc_smoe": (MergeStage, {"method": "hc_smoe"}),
}
ORDERINGS = [  # the REAP paper's claims: the first row beats the second
    ("reap", "frequency"), ("reap", "ean"), ("reap", "m_smoe"), ("reap", "hc_smoe"),
    ("frequency", "m_smoe"), ("frequency", "hc_smoe"), ("ean", "m_smoe"), ("ean", "hc_smoe"),
]


def seed_model(size: str, seed: int) -> Path:
    """The demo recipe ``size`` trained with ``seed`` (built once, then reused)."""
    spec = dataclasses.replace(SPECS[size], seed=seed)
    return build_from_spec(spec, demo_models_dir() / f"{size}-{demo_key(spec)}",
                           label=f"demo:{size} seed {seed}")


def scores(path: Path, windows: torch.Tensor, task: str, gen_limit: int) -> dict:
    """Per-window NLLs and per-prompt generative scores of one checkpoint."""
    nll = window_nlls(load_model(path), windows, show_progress=False).tolist()
    results = run_tasks(path, tasks=[task], limit=gen_limit, show_progress=False, engine=path)
    key = next(k for k in results.per_sample if k.endswith("char_similarity"))
    return {"nll": nll, "gen_key": key, "gen": results.per_sample[key]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:fine", help="demo:<size> (its recipe is retrained "
                    "per seed)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--samples", type=int, default=64, help="calibration windows")
    ap.add_argument("--windows", type=int, default=128, help="held-out windows scored")
    ap.add_argument("--block", type=int, default=8, help="neighbouring windows per block")
    ap.add_argument("--task", default=GENERATIVE[0], choices=GENERATIVE)
    ap.add_argument("--gen-limit", type=int, default=64, help="generative prompts scored")
    ap.add_argument("--cache", type=Path, default=Path("prune_merge.json"))
    args = ap.parse_args()
    size = args.model.removeprefix("demo:")
    if not args.model.startswith("demo:") or size not in SPECS:
        ap.error(f"--model: one of {', '.join('demo:' + s for s in SPECS)}")
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    cal = CalibrationConfig(samples=args.samples, seq_len=256)
    work = Path(tempfile.mkdtemp(prefix="thresher-prune-merge-"))
    start = time.perf_counter()
    try:
        for seed in args.seeds:
            base = seed_model(size, seed)
            tok = load_tokenizer(base)
            windows = eval_windows(tok, PerplexityConfig(seq_len=256, max_windows=args.windows))
            runs = cache.setdefault(f"{args.model} seed {seed}", {})
            if "base" not in runs:
                runs["base"] = scores(base, windows, args.task, args.gen_limit)
            for ratio in args.ratios:
                for row in args.rows:
                    label = f"{row} {ratio:g}"
                    if label in runs:
                        continue
                    cls, options = ROWS[row]
                    out = work / f"{seed}-{row.replace(' ', '_')}-{ratio:g}"
                    stage = cls(ratio=ratio, **options)
                    build = prune_model if cls is PruneStage else merge_model
                    build(base, stage, cal, out, show_progress=False)
                    runs[label] = scores(out, windows, args.task, args.gen_limit)
                    shutil.rmtree(out)
                    args.cache.write_text(json.dumps(cache))
            args.cache.write_text(json.dumps(cache))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(cache, args)
    print(f"\n{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - start:.0f} s this run; "
          f"calibration {args.samples} x 256, {args.windows} windows, blocks of {args.block}, "
          f"{args.gen_limit} {args.task} prompts")


def report(cache: dict, args: argparse.Namespace) -> None:
    """The per-seed table, the orderings' win rates and the drops relative to uniform REAP."""
    seeds = [f"{args.model} seed {s}" for s in args.seeds]
    deltas: dict[tuple[str, float, str], tuple[float, float]] = {}  # (seed, ratio, row) -> (ppl, gen)
    print("| ratio | row | " + " | ".join(f"seed {s}: perplexity (blocks) / generative"
                                           for s in args.seeds) + " |")
    print("|---|---|" + "---|" * len(seeds))
    for ratio in args.ratios:
        for row in args.rows:
            cells = []
            for seed in seeds:
                base, run = cache[seed]["base"], cache[seed][f"{row} {ratio:g}"]
                ppl = paired_perplexity(base["nll"], run["nll"], block=1)
                blocks = paired_perplexity(base["nll"], run["nll"], block=args.block)
                gen = paired_difference(*paired_documents(base["gen"], run["gen"]))
                _, lo, hi = (100 * r for r in blocks.ratio)
                cells.append(f"{ppl.describe()} ({lo:+.2f}%, {hi:+.2f}%) / {gen.describe()}")
                deltas[(seed, ratio, row)] = (ppl.ratio[0], gen.delta)
            print(f"| {ratio:g} | {row} | " + " | ".join(cells) + " |")
    print("\n| ratio | ordering | perplexity: seeds where it holds | generative |")
    print("|---|---|---|---|")
    for ratio in args.ratios:
        for a, b in ORDERINGS:
            if a not in args.rows or b not in args.rows:
                continue
            ppl = sum(deltas[(s, ratio, a)][0] < deltas[(s, ratio, b)][0] for s in seeds)
            gen = sum(deltas[(s, ratio, a)][1] > deltas[(s, ratio, b)][1] for s in seeds)
            print(f"| {ratio:g} | {a} ahead of {b} | {ppl}/{len(seeds)} | {gen}/{len(seeds)} |")
    if "reap" not in args.rows:
        return
    print("\n| ratio | row | drop / uniform REAP's drop, per seed: perplexity; generative |")
    print("|---|---|---|")
    for ratio in args.ratios:
        for row in args.rows:
            parts = []
            for s in seeds:
                (p, g), (rp, rg) = deltas[(s, ratio, row)], deltas[(s, ratio, "reap")]
                parts.append(f"{p / rp:.2f}; " + (f"{g / rg:.2f}" if rg < 0 else "n/a"))
            print(f"| {ratio:g} | {row} | " + " / ".join(parts) + " |")


if __name__ == "__main__":
    main()
