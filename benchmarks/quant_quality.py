"""Held-out perplexity and wall time of every quantization method on a demo model.

    python benchmarks/quant_quality.py --model demo:tiny --samples 64 --group-size 64

Prints a markdown table: float, RTN, GPTQ (with and without act-order), AWQ and NF4 at 4 and
3 bits, same calibration and the same held-out windows for all. AWQ at 3 bits has no checkpoint
format (gemm is 4-bit) and is evaluated in memory; every other row is evaluated from the artifact
reloaded from disk.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from thresher.compress.api import quantize_in_memory, quantize_model
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.models import load_model, load_tokenizer, resolve_model
from thresher.models.quantized import load_quantized_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage

ROWS = [("rtn", 4, {}), ("gptq", 4, {}), ("gptq", 4, {"act_order": True}), ("awq", 4, {}),
        ("nf4", 4, {}), ("rtn", 3, {}), ("gptq", 3, {}), ("gptq", 3, {"act_order": True}),
        ("awq", 3, {})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:tiny")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--windows", type=int, default=64)
    args = ap.parse_args()
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    heldout = PerplexityConfig(max_windows=args.windows)
    cal = CalibrationConfig(samples=args.samples)
    result = heldout_perplexity(load_model(path), heldout, tokenizer=tok, show_progress=False)
    fp = result.perplexity
    print(f"model {args.model}, calibration {args.samples} x 256 stdlib tokens, "
          f"{result.windows} held-out windows of 256, group size {args.group_size}\n")
    print("| method | bits | perplexity | vs float | quantize s |")
    print("|---|---|---|---|---|")
    print(f"| float | 32 | {fp:.3f} | - | - |")
    with tempfile.TemporaryDirectory() as tmp:
        for method, bits, extra in ROWS:
            gs = -1 if method == "nf4" else args.group_size
            stage = QuantizeStage(method="rtn").model_copy(
                update={"method": method, "bits": bits, "group_size": gs, **extra})
            start = time.perf_counter()
            if method == "awq" and bits != 4:
                model, _ = quantize_in_memory(path, stage, cal)
                where = " (in memory)"
            else:
                out = Path(tmp) / f"{method}{bits}{len(extra)}"
                quantize_model(path, stage, cal, out, show_progress=False)
                model = load_quantized_model(out)
                where = ""
            seconds = time.perf_counter() - start
            p = heldout_perplexity(model, heldout, tokenizer=tok, show_progress=False).perplexity
            name = method + (" act-order" if extra.get("act_order") else "") + where
            print(f"| {name} | {bits} | {p:.3f} | {100 * (p / fp - 1):+.2f}% | {seconds:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
