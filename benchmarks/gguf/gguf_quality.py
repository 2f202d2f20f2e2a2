"""GGUF types of one model through llama.cpp: size, bits per weight, perplexity, decode speed.

    PYTHONPATH=. python benchmarks/gguf/gguf_quality.py                # demo:small, recipe defaults
    PYTHONPATH=. python benchmarks/gguf/gguf_quality.py --model demo:tiny --samples 16 --windows 8
    PYTHONPATH=. python benchmarks/gguf/gguf_quality.py --types q4_1 q4_0 q4_k q3_k --no-decode
    PYTHONPATH=. python benchmarks/gguf/gguf_quality.py --score DIR --no-decode  # re-score --keep's files

Needs llama-cpp-python (``make llama``). Exports the model with thresher to every GGUF type,
plain and with an importance matrix from the calibration windows (``--samples`` of 256 tokens),
and adds three references: llama.cpp's own quantizer (``llama_model_quantize``, the library
behind ``llama-quantize``, no importance matrix) on thresher's F32 export for Q4_1, Q4_K_M and
Q3_K_M, and the lossless
hand-off of a GPTQ and an AWQ artifact quantized by thresher at 4 bits in groups of 32 with
asymmetric zeros (Q4_1 blocks: same size as Q4_1). Every file is scored by llama.cpp on the same
held-out windows (token-level perplexity, thresher's convention); bits per weight = tensor bytes
x 8 / tensor elements. For each type with and without the importance matrix, a paired comparison
on the same windows: the perplexity margin and on how many windows the imatrix file has the lower
loss. Then (unless --no-decode) decode speed of the same model in llama.cpp and in thresher's engine
(greedy, batch 1, prompt excluded), side by side. Prints two tables; files deleted unless --keep.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import gguf
import torch

from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity, window_nll
from thresher.export import compute_importance, export_gguf
from thresher.export.llama_runtime import LlamaCppModel
from thresher.models import resolve_model
from thresher.models.loading import load_model, load_tokenizer
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage

TYPES = ["f16", "q8_0", "q6_k", "q5_0", "q4_1", "q4_0", "q4_k", "q4_k_m", "q3_k", "q3_k_m"]
WEIGHTED = {"q6_k", "q5_0", "q4_1", "q4_0", "q4_k", "q4_k_m", "q3_k", "q3_k_m"}
# llama_ftype: MOSTLY_Q4_1, MOSTLY_Q4_K_M, MOSTLY_Q3_K_M
LLAMA_QUANTIZE = {"q4_1": 3, "q4_k_m": 15, "q3_k_m": 12}
PROMPT = [5, 17, 300, 42, 9, 77, 1023, 400, 12, 3, 250, 61, 8, 99, 150, 31]


def llama_cpp_losses(path: Path, windows: torch.Tensor, threads: int | None) -> torch.Tensor:
    """Each held-out window's next-token losses as llama.cpp computes them from the GGUF file
    (the other GGUF benchmarks import this)."""
    llm = LlamaCppModel(path, n_ctx=windows.shape[1], n_threads=threads)
    losses = torch.cat([window_nll(llm.logits(batch), batch) for batch in windows.split(8)])
    llm.close()
    return losses


def score_and_remove(path: Path, windows: torch.Tensor, threads: int | None
                     ) -> tuple[torch.Tensor, float]:
    """``llama_cpp_losses`` of a GGUF file and the perplexity they make; the file is deleted
    (the sweeps write one file per row)."""
    losses = llama_cpp_losses(path, windows, threads)
    path.unlink()
    return losses, math.exp(float(losses.sum()) / (windows.shape[0] * (windows.shape[1] - 1)))


def bits_per_weight(path: Path) -> float:
    tensors = gguf.GGUFReader(path).tensors
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def llama_quantize(src: Path, out: Path, ftype: int) -> None:
    """llama.cpp's own quantizer, as ``llama-quantize src out TYPE`` runs it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")


def engine_decode(path: Path, dtype: str, tokens: int) -> float:
    """Decode tokens/s of thresher's engine at batch 1, prompt excluded (as cpu_decode.py)."""
    from thresher.serve_kernels import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_seqs=1)

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    run(2)
    return tokens / (run(tokens + 1) - run(1))


def make_files(model: Path, root: Path, args, calibration: CalibrationConfig
               ) -> tuple[list, dict[str, Path], float]:
    """Every GGUF file of the benchmark, written to ``root``: thresher's types, plain and with
    the importance matrix, llama.cpp's own quantizations, and the GPTQ/AWQ hand-offs."""
    start = time.perf_counter()
    importance = compute_importance(model, calibration, show_progress=False)
    imatrix_seconds = time.perf_counter() - start
    files: list[tuple[str, str, Path, float]] = []  # type, how, file, export seconds
    for gguf_type in args.types:
        for weighted in (False, True) if gguf_type in WEIGHTED else (False,):
            out = root / f"{gguf_type}{'-imatrix' if weighted else ''}.gguf"
            result = export_gguf(model, out, gguf_type, show_progress=False,
                                 importance=importance if weighted else None)
            files.append((gguf_type, "thresher + imatrix" if weighted else "thresher", out,
                          result.wall_seconds))
    export_gguf(model, root / "f32.gguf", "f32", show_progress=False)
    for gguf_type, ftype in LLAMA_QUANTIZE.items():
        if gguf_type not in args.types:
            continue
        out = root / f"{gguf_type}-llama.gguf"
        start = time.perf_counter()
        llama_quantize(root / "f32.gguf", out, ftype)
        files.append((gguf_type, "llama.cpp llama-quantize", out, time.perf_counter() - start))
    from thresher.compress.api import quantize_model

    artifacts = {}
    for method, kw in (("gptq", {"sym": False}), ("awq", {})):
        if method not in args.handoff:
            continue
        artifacts[method] = root / method
        quantize_model(model, QuantizeStage(method=method, group_size=32, **kw), calibration,
                       artifacts[method], show_progress=False)
        out = root / f"{method}-q4_1.gguf"
        result = export_gguf(artifacts[method], out, "q4_1", show_progress=False)
        files.append(("q4_1", f"{method.upper()} g32 hand-off", out, result.wall_seconds))
    return files, artifacts, imatrix_seconds


def kept_files(root: Path, types: list[str]) -> tuple[list, dict[str, Path]]:
    """The files and artifacts a --keep run left in ``root``, named as make_files names them."""
    files = []
    for gguf_type in types:
        for suffix, how in (("", "thresher"), ("-imatrix", "thresher + imatrix"),
                            ("-llama", "llama.cpp llama-quantize")):
            if (root / f"{gguf_type}{suffix}.gguf").is_file():
                files.append((gguf_type, how, root / f"{gguf_type}{suffix}.gguf", float("nan")))
    artifacts = {m: root / m for m in ("gptq", "awq") if (root / m).is_dir()}
    files += [("q4_1", f"{m.upper()} g32 hand-off", root / f"{m}-q4_1.gguf", float("nan"))
              for m in artifacts if (root / f"{m}-q4_1.gguf").is_file()]
    return files, artifacts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--samples", type=int, default=128, help="calibration windows of 256 tokens")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed")
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--handoff", nargs="*", default=["gptq", "awq"], choices=["gptq", "awq"],
                    help="GPTQ/AWQ g32 artifacts to hand off to q4_1")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-speed table")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--score", type=Path, help="score the files a --keep run left in this "
                    "directory instead of exporting them again (kept afterwards)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    calibration = CalibrationConfig(samples=args.samples)
    windows = eval_windows(load_tokenizer(model), PerplexityConfig(max_windows=args.windows))
    root = args.score or Path(tempfile.mkdtemp(prefix="thresher-gguf-"))
    try:
        if args.score:
            files, artifacts = kept_files(root, args.types)
            imatrix_seconds = float("nan")
        else:
            files, artifacts, imatrix_seconds = make_files(model, root, args, calibration)

        base = perplexity(load_model(model), windows, show_progress=False).perplexity
        rows, window_losses = [], {}
        for gguf_type, how, path, seconds in files:
            losses = llama_cpp_losses(path, windows, args.threads)
            window_losses[(gguf_type, how)] = losses
            ppl = math.exp(float(losses.sum()) / (windows.numel() - windows.shape[0]))
            rows.append((gguf_type, how, path.stat().st_size / 1e6, bits_per_weight(path), ppl,
                         seconds))
        artifact_ppl = {m: perplexity(load_model(p), windows, show_progress=False).perplexity
                        for m, p in artifacts.items()}

        print(f"\n{args.model}: {windows.shape[0]} held-out windows of {windows.shape[1]} tokens; "
              f"imatrix from {args.samples} calibration windows of 256 tokens ({imatrix_seconds:.0f}"
              f" s); {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"{args.threads} threads\n")
        print(f"thresher perplexity of the source: {base:.3f}; of the GPTQ / AWQ g32 artifacts: "
              + " / ".join(f"{p:.3f}" for p in artifact_ppl.values()) + "\n")
        print("| type | quantized by | file MB | bits/weight | llama.cpp perplexity | vs source | "
              "export s |")
        print("|---|---|---|---|---|---|---|")
        for gguf_type, how, mb, bpw, ppl, seconds in rows:
            print(f"| {gguf_type} | {how} | {mb:.2f} | {bpw:.2f} | {ppl:.3f} | "
                  f"{ppl / base - 1:+.2%} | {seconds:.1f} |")

        print("\nimportance matrix against plain, paired on the same windows\n")
        print("| type | plain perplexity | imatrix perplexity | imatrix better by | windows "
              "imatrix better |")
        print("|---|---|---|---|---|")
        ppl_of = {(t, how): ppl for t, how, _, _, ppl, _ in rows}
        for gguf_type in args.types:
            if (gguf_type, "thresher + imatrix") not in window_losses:
                continue
            plain = window_losses[(gguf_type, "thresher")]
            weighted = window_losses[(gguf_type, "thresher + imatrix")]
            a, b = ppl_of[(gguf_type, "thresher")], ppl_of[(gguf_type, "thresher + imatrix")]
            print(f"| {gguf_type} | {a:.3f} | {b:.3f} | {a / b - 1:+.2%} | "
                  f"{int((weighted < plain).sum())}/{len(plain)} |")
        if args.no_decode:
            return

        speed = []
        for gguf_type, how, path, _ in files:
            if how in ("thresher", f"{'GPTQ'} g32 hand-off") and gguf_type in ("f16", "q8_0",
                                                                              "q4_k_m", "q4_1"):
                llm = LlamaCppModel(path, n_ctx=len(PROMPT) + args.tokens + 1,
                                    n_threads=args.threads)
                llm.greedy(PROMPT, 4)
                timing = llm.greedy(PROMPT, args.tokens)[1]
                llm.close()
                speed.append((f"llama.cpp {gguf_type} ({how})", timing.tokens_per_second))
        for name, path, dtype in (("float32", model, "float32"), ("bfloat16", model, "bfloat16"),
                                  ("GPTQ g32 int4", artifacts.get("gptq"), "float32")):
            if path is None:
                continue
            try:
                speed.append((f"thresher engine {name}", engine_decode(path, dtype, args.tokens)))
            except Exception as exc:  # a dtype the engine cannot serve is reported, not fatal
                speed.append((f"thresher engine {name} ({type(exc).__name__})", float("nan")))
        reference = speed[0][1]
        print(f"\ndecode, batch 1, {args.tokens} tokens after a {len(PROMPT)}-token prompt\n")
        print("| runtime and weights | tokens/s | vs llama.cpp f16 |")
        print("|---|---|---|")
        for name, rate in speed:
            print(f"| {name} | {rate:.1f} | {rate / reference:.2f}x |")
    finally:
        if args.keep or args.score:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
