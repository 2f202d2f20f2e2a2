"""Held-out perplexity and wall time of every quantization method and option on a demo model.

    python benchmarks/quality/quant_quality.py --model demo:tiny --samples 64 --group-size 64
    python benchmarks/quality/quant_quality.py --model demo:small --group-size 128 --bits 3 2

Prints a markdown table: float, then per bit width RTN (min-max and MSE scale search), GPTQ with
act-order (with and without MSE search, without the rare-expert rule, calibrated on all tokens,
routed tokens counted once or gate-weighted; the plain row is the default, ``auto``),
AWQ with and without clipping, and at 4 bits plain GPTQ and NF4; same calibration and the same
held-out windows for all. Every row is evaluated from the artifact reloaded from disk (AWQ below 4
bits writes the GPTQ format). ``--tune`` scores the tuning windows (``data.windows.tune_windows``)
instead of the evaluation windows: choose a default (``expert_weighting``) with it, report without.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from thresher.compress.api import quantize_model
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.models import load_model, load_tokenizer, resolve_model
from thresher.models.quantized import dequantize_once, load_quantized_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage

ACT = {"act_order": True}
ROWS = [  # (label, method, options); every row at every width asked for
    ("rtn", "rtn", {}),
    ("rtn mse", "rtn", {"scale_search": "mse"}),
    ("gptq act-order", "gptq", ACT),
    ("gptq act-order mse", "gptq", {**ACT, "scale_search": "mse"}),
    ("gptq act-order, no rare-expert rule", "gptq", {**ACT, "rare_expert_damping": False}),
    ("gptq act-order, experts on all tokens", "gptq", {**ACT, "expert_tokens": "all"}),
    ("gptq act-order, routed tokens once", "gptq", {**ACT, "expert_weighting": "once"}),
    ("gptq act-order, routed tokens gate-weighted", "gptq", {**ACT, "expert_weighting": "gate"}),
    ("awq (clip)", "awq", {}),
    ("awq scale-only", "awq", {"clip": False}),
]
FOUR_BIT_ONLY = [("gptq", "gptq", {}), ("nf4", "nf4", {})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:tiny")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    ap.add_argument("--only", nargs="+", default=[""],
                    help="run only the rows whose label contains one of these")
    ap.add_argument("--tune", action="store_true",
                    help="score the tuning windows, not the evaluation ones (choosing a default)")
    args = ap.parse_args()
    split = "tune" if args.tune else "eval"
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    heldout = PerplexityConfig(max_windows=args.windows)
    cal = CalibrationConfig(samples=args.samples)
    result = heldout_perplexity(load_model(path), heldout, tokenizer=tok, show_progress=False,
                                split=split)
    fp = result.perplexity
    print(f"model {args.model}, calibration {args.samples} x 256 stdlib tokens, "
          f"{result.windows} held-out {split} windows of 256, group size {args.group_size}\n")
    print("| method | bits | perplexity | vs float | quantize s |")
    print("|---|---|---|---|---|")
    print(f"| float | 32 | {fp:.3f} | - | - |")
    with tempfile.TemporaryDirectory() as tmp:
        for bits in args.bits:
            for i, (label, method, extra) in enumerate(ROWS + (FOUR_BIT_ONLY if bits == 4 else [])):
                if not any(part in label for part in args.only):
                    continue
                gs = -1 if method == "nf4" else args.group_size
                stage = QuantizeStage(method=method, bits=bits, group_size=gs, **extra)
                out = Path(tmp) / f"{bits}-{i}"
                start = time.perf_counter()
                quantize_model(path, stage, cal, out, show_progress=False)
                seconds = time.perf_counter() - start
                model = dequantize_once(load_quantized_model(out))
                p = heldout_perplexity(model, heldout, tokenizer=tok,
                                       show_progress=False, split=split).perplexity
                print(f"| {label} | {bits} | {p:.3f} | {100 * (p / fp - 1):+.2f}% | "
                      f"{seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
