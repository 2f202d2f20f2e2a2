"""Task scores of demo-model variants: base, compressed, and deliberately damaged controls.

    .venv/bin/python benchmarks/tasks.py [tiny|small] [--img docs/img]

Builds each variant through thresher's own stages (prune_model, quantize_model) in a temporary
directory, plus a noise-damaged control, then measures size, held-out perplexity and the three
built-in tasks (all questions) through lm-evaluation-harness. Prints a markdown table for
docs/benchmarks.md and writes the comparison report (the README's plot comes from here).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from thresher.compress.api import quantize_model
from thresher.data.demo_model import build_demo_model
from thresher.evaluate.builtin_tasks import TASKS
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.evaluate.report import VariantRecord, build_report
from thresher.evaluate.tasks import run_tasks
from thresher.models import load_model, load_tokenizer
from thresher.models.inspect import parameter_count, weight_bytes
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, PruneStage, QuantizeStage

CALIBRATION = CalibrationConfig(samples=64, seq_len=256)
VARIANTS = {
    "reap50": [PruneStage(method="reap", ratio=0.5)],
    "random75": [PruneStage(method="random", keep=2)],
    "rtn2": [QuantizeStage(method="rtn", bits=2, group_size=32)],
}


def build_variant(name: str, base: Path, stages: list, work: Path) -> Path:
    path = base
    for i, stage in enumerate(stages):
        out = work / f"{name}-{i}"
        if isinstance(stage, PruneStage):
            prune_model(path, stage, CALIBRATION, out)
        else:
            quantize_model(path, stage, CALIBRATION, out, show_progress=False)
        path = out
    return path


def noise_damaged(path: Path, relative_std: float = 2.0):
    model = load_model(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * relative_std)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("size", nargs="?", default="tiny")
    parser.add_argument("--img", type=Path, default=None, help="copy the plots here")
    parser.add_argument("--limit", type=int, default=None, help="questions per task (default all)")
    args = parser.parse_args()
    base = build_demo_model(args.size)
    tokenizer = load_tokenizer(base)
    heldout = PerplexityConfig(seq_len=256, max_windows=64)
    params = parameter_count(base)
    work = Path(tempfile.mkdtemp(prefix="thresher-bench-tasks-"))
    records, timings = [], {}
    try:
        variants: dict[str, tuple[Path, object]] = {"base": (base, load_model(base))}
        for name, stages in VARIANTS.items():
            path = build_variant(name, base, stages, work)
            variants[name] = (path, load_model(path))
        variants["noise2.0"] = (base, noise_damaged(base))
        for name, (path, model) in variants.items():
            ppl = heldout_perplexity(model, heldout, tokenizer=tokenizer,
                                     show_progress=False).perplexity
            start = time.perf_counter()
            results = run_tasks(model, tokenizer, list(TASKS), limit=args.limit, batch_size=32,
                                show_progress=False)
            timings[name] = time.perf_counter() - start
            size = weight_bytes(path)
            records.append(VariantRecord.from_metrics(name, {
                "size_bytes": float(size), "bits_per_param": 8.0 * size / params,
                "perplexity": ppl, **results.metrics()},
                {"stages": " -> ".join(s.describe() for s in VARIANTS.get(name, []))
                 or ("weight noise, 2 x std (control)" if name.startswith("noise") else "base")}))
        report = build_report(records, work / "report", title=f"demo:{args.size} variants")
        if args.img:
            args.img.mkdir(parents=True, exist_ok=True)
            for key in ("quality_vs_size", "task_scores"):
                shutil.copy(report.files[key], args.img / f"tasks_{args.size}_{key}.png")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, "
          f"python {platform.python_version()}, torch {torch.__version__}; "
          f"lm-eval {results.lm_eval_version}; {time.strftime('%Y-%m-%d')}; "
          f"questions per task: {args.limit or 'all'}\n")
    names = list(TASKS)
    print("| variant | stages | size (MB) | bits/param | perplexity | "
          + " | ".join(f"{t} acc" for t in names) + " | tasks wall (s) |")
    print("|---|---|---|---|---|" + "---|" * len(names) + "---|")
    for r in records:
        cells = [f"{r.tasks[f'{t}/acc']:.3f} ± {r.task_stderr[f'{t}/acc']:.3f}" for t in names]
        print(f"| {r.name} | {r.stages} | {r.size_bytes / 1e6:.2f} | {r.bits_per_param:.2f} | "
              f"{r.perplexity:.1f} | " + " | ".join(cells) + f" | {timings[r.name]:.0f} |")
    print(f"\nchance: {', '.join(f'{t} {TASKS[t].chance:.2f}' for t in names)}")


if __name__ == "__main__":
    main()
