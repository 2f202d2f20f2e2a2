"""Mixed precision (``bits: auto``) against uniform widths and random allocations of the same size.

    python benchmarks/quality/mixed_precision.py --model demo:small --group-size 128 --targets 2.5 3.5

GPTQ (act-order, the stage defaults otherwise) everywhere, same calibration and held-out windows.
Uniform 2, 3 and 4 bits give the baseline: at each target, the perplexity a uniform width would
have at the auto artifact's size, interpolated linearly between the neighbouring uniform widths at
their sizes. Each random control allocates the same budget from random damages
(``mixed.random_damage``), so every allocation of a target has the same average bits to within one
width step. Every row is evaluated from the artifact reloaded from disk.

On a loaded machine the rows can run in parallel processes and be joined afterwards:

    python benchmarks/quality/mixed_precision.py --rows uniform --uniform 3 --json rows.jsonl &
    python benchmarks/quality/mixed_precision.py --rows auto --targets 2.5 --json rows.jsonl &
    python benchmarks/quality/mixed_precision.py --rows random --targets 2.5 --seeds 0 1 2 --json rows.jsonl &
    ...
    python benchmarks/quality/mixed_precision.py --table rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from thresher.compress.api import quantize_model
from thresher.compress.mixed import Allocation, Unit, allocate, budget_bits, random_damage
from thresher.compress.targets import LayerParts, sequential_stages
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.models import load_model, load_tokenizer, resolve_model
from thresher.models.layerwise import LayerwiseModel
from thresher.models.quantized import dequantize_once, load_quantized_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--targets", type=float, nargs="*", default=[2.5, 3.5])
    ap.add_argument("--uniform", type=int, nargs="*", default=[2, 3, 4])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                    help="seeds of the random allocations of each target")
    ap.add_argument("--rows", nargs="+", default=["uniform", "auto", "random"],
                    choices=["uniform", "auto", "random"])
    ap.add_argument("--sensitivity", default="rtn", choices=["gptq", "rtn"])
    ap.add_argument("--json", type=Path, help="also append each row to this JSON-lines file")
    ap.add_argument("--table", type=Path, nargs="+", help="only print the table of these files")
    args = ap.parse_args()
    if args.table:
        rows = [json.loads(line) for f in args.table for line in f.read_text().splitlines()]
        print_table(rows)
        return
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    heldout = PerplexityConfig(max_windows=args.windows)
    cal = CalibrationConfig(samples=args.samples)
    fp = heldout_perplexity(load_model(path), heldout, tokenizer=tok,
                            show_progress=False).perplexity
    gs = args.group_size
    common = {"method": "gptq", "group_size": gs, "act_order": True}
    rows: list[dict] = []

    def run(label: str, target: str, stage: QuantizeStage, out: Path,
            allocation: Allocation | None = None) -> None:
        start = time.perf_counter()
        report = quantize_model(path, stage, cal, out, show_progress=False, allocation=allocation)
        seconds = time.perf_counter() - start
        ppl = heldout_perplexity(dequantize_once(load_quantized_model(out)), heldout, tokenizer=tok,
                                 show_progress=False).perplexity
        row = {"label": label, "target": target, "bits": report.metrics()["bits"],
               "mb": report.artifact_mb, "ppl": ppl, "float": fp, "seconds": seconds}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")

    print(f"model {args.model}, GPTQ act-order g{gs}, calibration {args.samples} x 256 stdlib "
          f"tokens, {args.windows} held-out windows of 256, float perplexity {fp:.3f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if "uniform" in args.rows:
            for b in args.uniform:
                run("uniform", f"{b}", QuantizeStage(**common, bits=b), Path(tmp) / f"u{b}")
        for i, target in enumerate(args.targets):
            stage = QuantizeStage(**common, bits="auto", target_bits=target,
                                  sensitivity=args.sensitivity)
            if "auto" in args.rows:
                run(f"auto ({args.sensitivity})", f"{target:g}", stage, Path(tmp) / f"a{i}")
            if "random" not in args.rows:
                continue
            for seed in args.seeds:
                control = random_damage(model_units(path, stage), stage.auto_widths, seed)
                budget, name = budget_bits(control, stage, 0.0)
                allocate(control, stage.auto_widths, gs, budget)
                run(f"random {seed}", f"{target:g}", stage, Path(tmp) / f"r{i}-{seed}",
                    Allocation(control, gs, budget, name))
    print_table(rows)


def model_units(path: Path, stage: QuantizeStage) -> list[Unit]:
    """The units ``bits: auto`` allocates (one per input site), read from the model's shapes."""
    lw = LayerwiseModel(path)
    units = []
    for i in range(lw.num_layers):  # layers stay on the meta device: shapes only
        for sites in sequential_stages(LayerParts(lw.adapter, lw.layer(i), i,
                                                  set(stage.keep_16bit))):
            units += [Unit(s.name, [t.key for t in s.targets],
                           [tuple(t.weight.shape) for t in s.targets]) for s in sites]
    return units


def print_table(rows: list[dict]) -> None:
    uniform = {r["target"]: r for r in rows if r["label"] == "uniform"}
    print("\n| allocation | target bits | average bits | artifact MB | perplexity | vs float "
          "| uniform at this size | vs uniform |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["label"] != "uniform", r["target"], r["label"])):
        ref = delta = "-"
        interp = _interpolate(list(uniform.values()), r["mb"])
        if r["label"] != "uniform" and interp is not None:
            ref, delta = f"{interp:.3f}", f"{100 * (r['ppl'] / interp - 1):+.2f}%"
        print(f"| {r['label']} | {r['target']} | {r['bits']:.3f} | {r['mb']:.3f} | "
              f"{r['ppl']:.3f} | {100 * (r['ppl'] / r['float'] - 1):+.2f}% | {ref} | {delta} |")


def _interpolate(uniform: list[dict], mb: float) -> float | None:
    """Perplexity of a uniform width at ``mb``, linear between the neighbouring widths' sizes."""
    points = sorted((r["mb"], r["ppl"]) for r in uniform)
    for (m0, p0), (m1, p1) in zip(points, points[1:], strict=False):
        if m0 <= mb <= m1:
            return p0 + (p1 - p0) * (mb - m0) / (m1 - m0)
    return None


if __name__ == "__main__":
    main()
