"""GGUF block types rounded by GPTQ, against plain and ``--imatrix`` files, through llama.cpp.

Each type is rounded by GPTQ against each matrix's Hessian, next to the plain and the
importance-weighted (``--imatrix``) files of the same type.

    PYTHONPATH=. python benchmarks/gguf/gguf_gptq.py                          # demo:small
    PYTHONPATH=. python benchmarks/gguf/gguf_gptq.py --model /work/seeds/small-seed1 --types q3_k q4_0

Needs llama-cpp-python (``make llama``). One calibration pass (``--samples`` windows of 256
tokens) collects the importance matrix and the Hessians; each type is exported plain, with the
importance matrix, rounded by GPTQ with the importance-weighted fit's scales (``gptq``) and with
the plain fit's (``gptq-plain-scales``), and llama.cpp scores every file on the same held-out
windows. Prints the file size, the perplexity, its margin over the plain file, on how many
windows it has the lower loss, and the export time.

``--proxy`` prints instead, per type, GPTQ's objective summed over the weight matrices,
sum tr((W - Q) H (W - Q)^T), for the importance-weighted fit's own rounding and for GPTQ's on the
same scales, with H from the calibration windows (what GPTQ minimizes) and from the held-out
windows (whether the gain carries to other text).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import gguf
import torch
from gguf_quality import score_and_remove

from thresher.data.windows import eval_windows
from thresher.export import ImportanceMatrix, compute_importance, export_gguf
from thresher.export.block_gptq import gptq_quantize, output_error
from thresher.export.block_quants import quantize
from thresher.models import resolve_model
from thresher.models.checkpoint import CheckpointReader
from thresher.models.loading import load_tokenizer
from thresher.recipe import CalibrationConfig, PerplexityConfig

TYPES = ["q4_0", "q4_1", "q4_k", "q3_k", "q4_k_m", "q3_k_m"]
ROUNDINGS = ["plain", "imatrix", "gptq", "gptq-plain-scales"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--samples", type=int, default=64, help="calibration windows of 256 tokens")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--proxy", action="store_true", help="the summed output error instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    windows = eval_windows(load_tokenizer(model), PerplexityConfig(max_windows=args.windows))
    start = time.perf_counter()
    importance = compute_importance(model, CalibrationConfig(samples=args.samples),
                                    show_progress=False, hessians=True)
    collect_s = time.perf_counter() - start
    if args.proxy:
        held_out = compute_importance(model, windows=windows, show_progress=False, hessians=True)
        proxy(model, args.types, importance, held_out)
        return
    root = Path(tempfile.mkdtemp(prefix="thresher-gguf-gptq-"))
    print(f"\n{args.model}: {windows.shape[0]} held-out windows of {windows.shape[1]} tokens; "
          f"importance and Hessians from {args.samples} calibration windows ({collect_s:.0f} s)\n")
    print("| type | rounding | file MB | llama.cpp perplexity | better than plain by | "
          "windows better | export s |")
    print("|---|---|---|---|---|---|---|")
    try:
        for gguf_type in args.types:
            plain = None
            for rounding in ROUNDINGS:
                out = root / f"{gguf_type}-{rounding}.gguf"
                result = export_gguf(model, out, gguf_type, show_progress=False,
                                     importance=None if rounding == "plain" else importance,
                                     gptq=rounding.startswith("gptq"),
                                     gptq_scales="plain" if "plain" in rounding else "imatrix")
                losses, ppl = score_and_remove(out, windows, args.threads)
                if plain is None:
                    plain = (losses, ppl)
                print(f"| {gguf_type} | {rounding} | {result.file_bytes / 1e6:.2f} | {ppl:.3f} | "
                      f"{plain[1] / ppl - 1:+.2%} | {int((losses < plain[0]).sum())}/{len(losses)} "
                      f"| {result.wall_seconds:.0f} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def proxy(model: Path, types: list[str], calib: ImportanceMatrix, held: ImportanceMatrix) -> None:
    """Summed output error of the fit's rounding and GPTQ's on every matrix that fits the type's
    blocks, under the calibration and the held-out Hessians."""
    from thresher.export.gguf import GGUF_TYPES

    reader = CheckpointReader(model)
    print("| type | matrices | calibration H: fit | GPTQ | GPTQ / fit | held-out H: fit | GPTQ | "
          "GPTQ / fit |")
    print("|---|---|---|---|---|---|---|---|")
    for gguf_type in types:
        qtype = GGUF_TYPES[gguf_type].default
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        sums = torch.zeros(4, dtype=torch.float64)
        count = 0
        for key in sorted(calib.hessians or {}):
            h, h_out = calib.hessian(key), held.hessian(key)
            if h is None or h_out is None or h.shape[0] % block or key not in reader:
                continue
            weights = reader.get(key).float().numpy()
            fit = gguf.quants.dequantize(quantize(weights, qtype, calib.get(key)), qtype)
            _, ours = gptq_quantize(weights, qtype, h)
            sums += torch.tensor([output_error(weights, fit, h), output_error(weights, ours, h),
                                  output_error(weights, fit, h_out),
                                  output_error(weights, ours, h_out)], dtype=torch.float64)
            count += 1
        a, b, c, d = sums.tolist()
        print(f"| {gguf_type} | {count} | {a:.2f} | {b:.2f} | {b / a:.3f} | {c:.2f} | {d:.2f} | "
              f"{d / c:.3f} |", flush=True)


if __name__ == "__main__":
    main()
