"""Ways of weighting the importance matrix, each against the plain GGUF type, through llama.cpp.

    PYTHONPATH=. python benchmarks/gguf/imatrix_weighting.py                    # demo:small, q3_k
    PYTHONPATH=. python benchmarks/gguf/imatrix_weighting.py --types q3_k q4_0 --variants imatrix \
        seed=1 samples=256 shrink=1024 pool pow=0.5 pow=0 only=k_proj

Needs llama-cpp-python (``make llama``). Exports the model plain and with each variant of the
importance matrix, scores every file with llama.cpp on the same held-out windows, and prints
each variant's perplexity, its margin over the plain file and on how many windows it has the
lower loss. Variants (``--samples`` calibration windows of 256 tokens unless they say otherwise):

    imatrix       llama.cpp's definition, as ``thresher export gguf --imatrix`` collects it
    seed=S        the same from other calibration windows (calibration seed S)
    samples=N     the same from N calibration windows
    shrink=N0     each expert's vector pulled toward its layer's pooled vector (all routed tokens
                  of that projection) as if it had N0 more tokens: (n*v + N0*pooled) / (n + N0)
    pool          every expert of a layer gets the pooled vector (shrink with N0 -> infinity)
    pow=P         each vector raised to P (P=0: uniform importance through the weighted search)
    only=NAME     the importance only for matrices whose checkpoint key contains NAME
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from gguf_quality import score_and_remove

from thresher.data.windows import eval_windows
from thresher.export import ImportanceMatrix, compute_importance, export_gguf
from thresher.models import resolve_model
from thresher.models.loading import load_tokenizer
from thresher.recipe import CalibrationConfig, PerplexityConfig

VARIANTS = ["imatrix", "seed=1", "samples=256", "shrink=1024", "pool", "pow=0.5", "pow=0"]


def _copy(imp: ImportanceMatrix) -> ImportanceMatrix:
    return ImportanceMatrix(sums=dict(imp.sums), tokens=dict(imp.tokens), windows=imp.windows,
                            dataset=imp.dataset)


def shrink(imp: ImportanceMatrix, n0: float) -> ImportanceMatrix:
    """Each expert's vector toward the pooled vector of its layer and projection."""
    out = _copy(imp)
    pooled: dict[str, tuple[torch.Tensor, int]] = {}
    group = {k: k.split(".experts.")[0] + "." + k.rsplit(".", 2)[-2]
             for k in imp.sums if ".experts." in k}
    for k, g in group.items():
        s, n = pooled.get(g, (0, 0))
        pooled[g] = (s + imp.sums[k], n + imp.tokens[k])
    for k, g in group.items():
        s, n = pooled[g]
        if math.isinf(n0):
            out.sums[k], out.tokens[k] = s, n
        else:
            out.sums[k] = imp.sums[k] + n0 * s / n
            out.tokens[k] = imp.tokens[k] + int(n0)
    return out


def power(imp: ImportanceMatrix, p: float) -> ImportanceMatrix:
    out = _copy(imp)
    for k, n in imp.tokens.items():
        if n:
            out.sums[k] = (imp.sums[k] / n) ** p * n
    return out


def only(imp: ImportanceMatrix, name: str) -> ImportanceMatrix:
    out = _copy(imp)
    for k in imp.tokens:
        if name not in k:
            out.tokens[k] = 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--samples", type=int, default=64, help="calibration windows of 256 tokens")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    ap.add_argument("--types", nargs="+", default=["q3_k"])
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    windows = eval_windows(load_tokenizer(model), PerplexityConfig(max_windows=args.windows))
    collected: dict[tuple[int, int], ImportanceMatrix] = {}

    def collect(seed: int = 0, samples: int = args.samples) -> ImportanceMatrix:
        if (seed, samples) not in collected:
            collected[seed, samples] = compute_importance(
                model, CalibrationConfig(samples=samples, seed=seed), show_progress=False)
        return collected[seed, samples]

    def importance(variant: str) -> ImportanceMatrix:
        kind, _, arg = variant.partition("=")
        if kind == "imatrix":
            return collect()
        if kind == "seed":
            return collect(seed=int(arg))
        if kind == "samples":
            return collect(samples=int(arg))
        if kind in ("shrink", "pool"):
            return shrink(collect(), float(arg) if arg else math.inf)
        if kind == "pow":
            return power(collect(), float(arg))
        if kind == "only":
            return only(collect(), arg)
        raise SystemExit(f"unknown variant {variant!r}")

    root = Path(tempfile.mkdtemp(prefix="thresher-imatrix-"))
    print(f"\n{args.model}: {windows.shape[0]} held-out windows of {windows.shape[1]} tokens; "
          f"importance from {args.samples} calibration windows unless the variant says\n")
    print("| type | importance | llama.cpp perplexity | better than plain by | windows better |")
    print("|---|---|---|---|---|")
    try:
        for gguf_type in args.types:
            plain = None
            for variant in ["plain", *args.variants]:
                out = root / f"{gguf_type}-{len(list(root.iterdir()))}.gguf"
                export_gguf(model, out, gguf_type, show_progress=False,
                            importance=None if variant == "plain" else importance(variant))
                losses, ppl = score_and_remove(out, windows, args.threads)
                if plain is None:
                    plain = (losses, ppl)
                print(f"| {gguf_type} | {variant} | {ppl:.3f} | {plain[1] / ppl - 1:+.2%} | "
                      f"{int((losses < plain[0]).sum())}/{len(losses)} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
