"""Task scores of demo-model variants: base, compressed, and deliberately damaged controls.

    .venv/bin/python benchmarks/quality/tasks.py [tiny|small] [--limit N] [--gen-limit N]
        [--model DIR] [--variants reap50,rtn2,...|demo] [--img docs/img]

Builds each variant through thresher's own stages (prune_model, quantize_model) in a temporary
directory, plus a noise-damaged control (saved, so that the engine can load it), then measures
size, held-out perplexity, the multiple-choice built-in tasks (through lm-eval's log-likelihoods)
and the generative ones (greedy, through the serving engine). Every variant is compared with the
base on the same documents: the paired difference with its 95% bootstrap interval (``*`` beyond
noise). The last table ranks the variants by each task's primary metric and gives its Spearman
correlation with the perplexity ranking. ``--model`` scores another trained model of the same
size (a second training seed) in place of the cached demo model.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

import thresher
from thresher.compress.api import quantize_model
from thresher.data.demo_model import build_demo_model
from thresher.evaluate.builtin_tasks import GENERATIVE, MULTIPLE_CHOICE, TASKS
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.evaluate.report import VariantRecord, build_report, paired_deltas
from thresher.evaluate.tasks import run_tasks
from thresher.models import load_model, load_tokenizer, save_model
from thresher.models.inspect import parameter_count, weight_bytes
from thresher.prune.api import prune_model
from thresher.recipe import (
    CalibrationConfig,
    PerplexityConfig,
    PruneStage,
    QuantizeStage,
    load_recipe,
)

CALIBRATION = CalibrationConfig(samples=64, seq_len=256)
VARIANTS = {
    "reap50": [PruneStage(method="reap", ratio=0.5)],
    "random75": [PruneStage(method="random", keep=2)],
    "rtn2": [QuantizeStage(method="rtn", bits=2, group_size=32)],
    "gptq4": [QuantizeStage(method="gptq", bits=4, group_size=128, act_order=True)],
    "nf4": [QuantizeStage(method="nf4")],
    "reap50-gptq4": [PruneStage(method="reap", ratio=0.5),
                     QuantizeStage(method="gptq", bits=4, group_size=128, act_order=True)],
}
# ``--variants demo``: the embedded demo recipe's variants, read from it, so they stay its own
DEMO = load_recipe(Path(thresher.__file__).parent / "configs" / "demo.yaml")
VARIANTS.update({v.name: [s.prune or s.quantize for s in v.stages]
                 for v in DEMO.variants if v.stages})
SETS = {"demo": ",".join(v.name for v in DEMO.variants if v.stages)}
DEFAULT_VARIANTS = "reap50,random75,rtn2"
PRIMARY = {"stdlib_complete_line": "char_similarity", "stdlib_function_body": "char_similarity"}


def build_variant(name: str, base: Path, stages: list, work: Path,
                  built: dict[tuple, Path]) -> Path:
    """Run ``stages`` on ``base``; a stage prefix another variant already ran is reused."""
    path = base
    for i, stage in enumerate(stages):
        key = tuple(s.describe() for s in stages[: i + 1])
        if key not in built:
            out = work / f"{name}-{i}"
            if isinstance(stage, PruneStage):
                prune_model(path, stage, CALIBRATION, out)
            else:
                quantize_model(path, stage, CALIBRATION, out, show_progress=False)
            built[key] = out
        path = built[key]
    return path


def noise_damaged(path: Path, out: Path, relative_std: float = 2.0) -> Path:
    model = load_model(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * relative_std)
    return save_model(model, load_tokenizer(path), out)


def primary(task: str) -> str:
    return PRIMARY.get(task, "acc")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("size", nargs="?", default="tiny")
    parser.add_argument("--model", type=Path, default=None,
                        help="a trained model directory to use as the base (another seed)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, of {', '.join(VARIANTS)}; or 'demo' for "
                             "configs/demo.yaml's variants")
    parser.add_argument("--tasks", default=",".join([*MULTIPLE_CHOICE, *GENERATIVE]))
    parser.add_argument("--img", type=Path, default=None, help="copy the plots here")
    parser.add_argument("--limit", type=int, default=None,
                        help="questions per multiple-choice task (default all)")
    parser.add_argument("--gen-limit", type=int, default=None,
                        help="prompts per generative task (default all)")
    args = parser.parse_args()
    base = args.model or build_demo_model(args.size)
    tokenizer = load_tokenizer(base)
    heldout = PerplexityConfig(seq_len=256, max_windows=64)
    params = parameter_count(base)
    tasks = args.tasks.split(",")
    names = SETS.get(args.variants, args.variants).split(",") if args.variants else []
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    work = Path(tempfile.mkdtemp(prefix="thresher-bench-tasks-"))
    records, timings = [], {}
    try:
        variants, built = {"base": base}, {}
        for name in names:
            variants[name] = build_variant(name, base, VARIANTS[name], work, built)
        variants["noise2.0"] = noise_damaged(base, work / "noise2.0")
        for name, path in variants.items():
            ppl = heldout_perplexity(load_model(path), heldout, tokenizer=tokenizer,
                                     show_progress=False).perplexity
            metrics, samples, timings[name] = {}, {}, {}
            for group, limit in (([t for t in tasks if t in MULTIPLE_CHOICE], args.limit),
                                 ([t for t in tasks if t not in MULTIPLE_CHOICE], args.gen_limit)):
                if not group:
                    continue
                start = time.perf_counter()
                results = run_tasks(path, tasks=group, limit=limit, batch_size=32,
                                    show_progress=False)
                timings[name]["gen" if group[0] in GENERATIVE else "mc"] = (
                    time.perf_counter() - start)
                metrics.update(results.metrics())
                samples.update(results.per_sample)
            size = weight_bytes(path)
            records.append(VariantRecord.from_metrics(name, {
                "size_bytes": float(size), "bits_per_param": 8.0 * size / params,
                "perplexity": ppl, **metrics},
                {"stages": " -> ".join(s.describe() for s in VARIANTS.get(name, []))
                 or ("weight noise, 2 x std (control)" if name.startswith("noise") else "base")},
                task_samples=samples))
        report = build_report(records, work / "report", title=f"demo:{args.size} variants")
        if args.img:
            args.img.mkdir(parents=True, exist_ok=True)
            for key in ("quality_vs_size", "task_scores"):
                shutil.copy(report.files[key], args.img / f"tasks_{args.size}_{key}.png")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, "
          f"python {platform.python_version()}, torch {torch.__version__}; "
          f"lm-eval {results.lm_eval_version}; {time.strftime('%Y-%m-%d')}; model {base}; "
          f"questions per task: {args.limit or 'all'} (multiple choice), "
          f"{args.gen_limit or 'all'} (generative)\n")
    paired = paired_deltas(records)
    keys = [f"{t}/{primary(t)}" for t in tasks]
    print("| variant | stages | size (MB) | perplexity | " + " | ".join(keys)
          + " | tasks wall (s): mc, gen |")
    print("|---|---|---|---|" + "---|" * len(keys) + "---|")
    for r in records:
        cells = []
        for k in keys:
            cell = f"{r.tasks[k]:.3f}"
            if k in paired.get(r.name, {}):
                cell += f" ({paired[r.name][k].describe()})"
            cells.append(cell)
        wall = ", ".join(f"{timings[r.name].get(g, 0):.0f}" for g in ("mc", "gen"))
        print(f"| {r.name} | {r.stages} | {r.size_bytes / 1e6:.2f} | {r.perplexity:.1f} | "
              + " | ".join(cells) + f" | {wall} |")
    print("\ncells: score (Δ vs base [95% paired bootstrap CI], * = beyond noise); chance: "
          + ", ".join(f"{t} {TASKS[t].chance:.2f}" for t in tasks if TASKS[t].chance))
    print("\n| task metric | Spearman vs perplexity (all variants) | without the noise control |")
    print("|---|---|---|")
    for k in keys:
        rows = [(r.perplexity, r.tasks[k], r.name) for r in records]
        rho_all = spearmanr([-p for p, _, _ in rows], [s for _, s, _ in rows]).statistic
        kept = [row for row in rows if not row[2].startswith("noise")]
        rho = spearmanr([-p for p, _, _ in kept], [s for _, s, _ in kept]).statistic
        print(f"| {k} | {rho_all:+.2f} | {rho:+.2f} |")


if __name__ == "__main__":
    main()
