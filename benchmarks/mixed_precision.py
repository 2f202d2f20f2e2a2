"""Mixed precision (``bits: auto``) against uniform widths and random allocations of the same size.

    python benchmarks/mixed_precision.py --model demo:small --group-size 128 --targets 2.5 3.5

GPTQ (act-order, the stage defaults otherwise) everywhere, same calibration and held-out windows.
Uniform 2, 3 and 4 bits give the baseline: at each target, the perplexity a uniform width would
have at the auto artifact's size, interpolated linearly between the neighbouring uniform widths at
their sizes. The auto allocation's damage table is measured once (the first target's run); the
other targets allocate from the same table, and each random control allocates the same budget
from random damages (``mixed.random_damage``), so every allocation of a target has the same
average bits to within one width step. Every row is evaluated from the artifact reloaded from disk.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from thresher.compress.api import quantize_model
from thresher.compress.mixed import Allocation, Unit, allocate, budget_bits, random_damage
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.models import load_model, load_tokenizer, resolve_model
from thresher.models.quantized import load_quantized_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage

UNIFORM = (2, 3, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--targets", type=float, nargs="+", default=[2.5, 3.5])
    ap.add_argument("--random", type=int, default=3, help="random allocations per target")
    ap.add_argument("--sensitivity", default="gptq", choices=["gptq", "rtn"])
    ap.add_argument("--uniform", type=int, nargs="*", default=list(UNIFORM),
                    help="uniform widths to run (none: only the targets' rows, e.g. to run the "
                    "targets in parallel processes; the table then has no interpolation)")
    args = ap.parse_args()
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    heldout = PerplexityConfig(max_windows=args.windows)
    cal = CalibrationConfig(samples=args.samples)
    fp = heldout_perplexity(load_model(path), heldout, tokenizer=tok,
                            show_progress=False).perplexity
    gs = args.group_size
    common = {"method": "gptq", "group_size": gs, "act_order": True}
    rows: list[tuple[str, str, float, float, float, float]] = []  # label, target, bits, MB, ppl, s

    def run(label: str, target: str, stage: QuantizeStage, out: Path,
            allocation: Allocation | None = None) -> dict:
        start = time.perf_counter()
        report = quantize_model(path, stage, cal, out, show_progress=False, allocation=allocation)
        seconds = time.perf_counter() - start
        ppl = heldout_perplexity(load_quantized_model(out), heldout, tokenizer=tok,
                                 show_progress=False).perplexity
        bits = report.metrics()["bits"]
        rows.append((label, target, bits, report.artifact_mb, ppl, seconds))
        print(f"  {label} {target}: {bits:.3f} bits, {report.artifact_mb:.3f} MB, "
              f"ppl {ppl:.3f} ({seconds:.0f} s)", flush=True)
        return report.allocation or {}

    print(f"model {args.model}, GPTQ act-order g{gs}, calibration {args.samples} x 256 stdlib "
          f"tokens, {args.windows} held-out windows of 256, float perplexity {fp:.3f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        uniform = {}
        for b in args.uniform:
            run("uniform", f"{b}", QuantizeStage(**common, bits=b), Path(tmp) / f"u{b}")
            uniform[b] = rows[-1]
        units: list[Unit] = []
        for i, target in enumerate(args.targets):
            stage = QuantizeStage(**common, bits="auto", target_bits=target,
                                  sensitivity=args.sensitivity)
            given = None
            if units:  # the damage table of the first run, allocated for this target
                budget, name = budget_bits(units, stage, 0.0)
                allocate(units, stage.auto_widths, gs, budget)
                given = Allocation(units, gs, budget, name)
            summary = run("auto", f"{target:g}", stage, Path(tmp) / f"a{i}", given)
            if not units:
                units = [Unit.from_dict(u) for u in summary["units"]]
            for seed in range(args.random):
                control = random_damage(units, stage.auto_widths, seed)
                budget, name = budget_bits(control, stage, 0.0)
                allocate(control, stage.auto_widths, gs, budget)
                run(f"random {seed}", f"{target:g}", stage, Path(tmp) / f"r{i}-{seed}",
                    Allocation(control, gs, budget, name))

    print("\n| allocation | target bits | average bits | artifact MB | perplexity | vs float "
          "| uniform at this size | vs uniform | quantize s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, target, bits, mb, ppl, seconds in rows:
        ref = "-"
        delta = "-"
        if label != "uniform":
            interp = _interpolate(uniform, mb)
            if interp is not None:
                ref, delta = f"{interp:.3f}", f"{100 * (ppl / interp - 1):+.2f}%"
        print(f"| {label} | {target} | {bits:.3f} | {mb:.3f} | {ppl:.3f} | "
              f"{100 * (ppl / fp - 1):+.2f}% | {ref} | {delta} | {seconds:.0f} |")


def _interpolate(uniform: dict[int, tuple], mb: float) -> float | None:
    """Perplexity of a uniform width at ``mb``, linear between the neighbouring widths' sizes."""
    if len(uniform) < 2:
        return None
    points = sorted((row[3], row[4]) for row in uniform.values())
    for (m0, p0), (m1, p1) in zip(points, points[1:], strict=False):
        if m0 <= mb <= m1:
            return p0 + (p1 - p0) * (mb - m0) / (m1 - m0)
    return None


if __name__ == "__main__":
    main()
