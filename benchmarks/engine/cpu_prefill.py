"""CPU prompt processing (prefill) of one random MoE: the engine against llama.cpp.

    PYTHONPATH=. python benchmarks/engine/cpu_prefill.py --threads 2 --prompts 128 512 2048

Time to the first token of one prompt (no prefix cache, nothing generated after it), as prompt
tokens per second, for the engine's bf16 model and GPTQ-4 artifact and llama.cpp's F16 and Q4_0
exports of the same weights, with the same thread count (llama.cpp keeps the last position's
logits only, as it serves a prompt). The GPTQ-4 row runs twice: as served (from
``cpu_q4.DEQUANT_ROWS`` rows on, each matrix dequantized to bf16 once per call for torch's
matmul, where that matmul has AMX tiles) and with every row on the integer kernel. The NF4
artifact (where bitsandbytes has its CPU kernel) runs as served (dequantized by thresher's C
pass from ``cpu_nf4.dequantize_rows`` rows) and with bitsandbytes' dequantization and that
path's row thresholds, as without thresher's C kernels. Rounds
alternate the variants; each reports its best. Models and exports are built as
``cpu_decode.py`` builds them (``--workdir`` shares them with it).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from cpu_decode import BUILDERS, gguf_exports, long_enough, prompt_of, quantize  # this directory's

from thresher.export.llama_runtime import LlamaCppModel
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.kernels import cpu_blocked, cpu_nf4, cpu_q4

INTEGER = "engine GPTQ-4 integer kernel"
NF4_BNB = "engine NF4 bitsandbytes dequantize"


def engine_seconds(llm: LLM, prompt: list[int], mode: str = "") -> float:
    """Seconds from submitting ``prompt`` to its first token; ``mode`` "integer" keeps 4-bit
    rows on the integer kernel, "bnb" dequantizes NF4 with bitsandbytes (both read per call)."""
    rows, own = cpu_q4.DEQUANT_ROWS, cpu_nf4.loaded
    cpu_q4.DEQUANT_ROWS = 1 << 30 if mode == "integer" else rows
    if mode == "bnb":
        cpu_nf4.loaded = lambda: None
    try:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return time.perf_counter() - start
    finally:
        cpu_q4.DEQUANT_ROWS, cpu_nf4.loaded = rows, own


def build(root: Path, args: argparse.Namespace, formats: list[str]
          ) -> tuple[Path, dict[str, Path], list[tuple[str, Path]]]:
    """The random model, its artifacts in ``formats`` and GGUF exports under ``root`` (reused
    there)."""
    src = root / "model"
    if not (src / "config.json").is_file():
        BUILDERS[args.family](src, args.layers, args.hidden, args.experts, args.intermediate,
                              args.top_k)
    artifacts = {fmt: root / fmt for fmt in formats}
    for fmt, path in artifacts.items():
        if not (path / "config.json").is_file():
            quantize(src, path, fmt)
    for path in (src, *artifacts.values()):
        long_enough(path, max(args.prompts) + 8)
    return src, artifacts, gguf_exports(root, src, ["f16", "q4_0"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=list(BUILDERS), default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 2048],
                    help="prompt lengths (tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch and llama.cpp threads (default: torch's)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="build here and keep; what is already there is reused")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if cpu_q4.library() is None:
        raise SystemExit("thresher's C kernels do not build here: no integer kernel to compare")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="thresher-cpu-prefill-"))
    try:
        formats = ["gptq4", "nf4"] if cpu_nf4.cpu_nf4_available() else ["gptq4"]
        src, artifacts, ggufs = build(root, args, formats)
        max_len = max(args.prompts) + 8
        kw = dict(dtype="bfloat16", max_model_len=max_len, max_num_batched_tokens=max_len,
                  enable_prefix_caching=False)
        engines = {"engine bf16": (LLM(src, **kw), ""),
                   "engine GPTQ-4": (LLM(artifacts["gptq4"], **kw), "")}
        engines[INTEGER] = (engines["engine GPTQ-4"][0], "integer")
        if "nf4" in artifacts:
            engines["engine NF4"] = (LLM(artifacts["nf4"], **kw), "")
            engines[NF4_BNB] = (engines["engine NF4"][0], "bnb")
        llamas = {name: LlamaCppModel(path, n_ctx=max_len, n_threads=threads, logits_all=False)
                  for name, path in ggufs}
        best: dict[str, list[float]] = {n: [float("inf")] * len(args.prompts)
                                        for n in [*engines, *llamas]}
        try:
            for llm, mode in engines.values():  # warm-up: kernels, buffers
                engine_seconds(llm, prompt_of(min(args.prompts)), mode)
            for r in range(args.repeats):
                for i, n in enumerate(args.prompts):
                    prompt = prompt_of(n, r + 1)
                    for name, (llm, mode) in engines.items():
                        best[name][i] = min(best[name][i], engine_seconds(llm, prompt, mode))
                    for name, llama in llamas.items():
                        seconds = llama.greedy(prompt, 1)[1].prompt_seconds
                        best[name][i] = min(best[name][i], seconds)
        finally:
            for llama in llamas.values():
                llama.close()
        amx = cpu_blocked.amx_matmul()
        print(f"\n{platform.processor() or platform.machine()}, {threads} threads, torch "
              f"{torch.__version__}; bf16 matmul on AMX tiles: {'yes' if amx else 'no'} "
              f"(dequantized prefill from {cpu_q4.DEQUANT_ROWS} rows)\n")
        print("| variant | " + " | ".join(f"{n} tokens: tok/s" for n in args.prompts) + " |")
        print("|---|" + "---|" * len(args.prompts))
        for name, seconds in best.items():
            print(f"| {name} | " + " | ".join(f"{n / s:.0f}" for n, s in
                                              zip(args.prompts, seconds, strict=True)) + " |")
        print("\n| ratio | " + " | ".join(f"{n} tokens" for n in args.prompts) + " |")
        print("|---|" + "---|" * len(args.prompts))
        pairs = [("engine GPTQ-4", INTEGER), ("engine GPTQ-4", "engine bf16"),
                 ("engine GPTQ-4", "llama.cpp Q4_0"), ("engine bf16", "llama.cpp F16"),
                 ("engine NF4", NF4_BNB), ("engine NF4", "engine bf16"),
                 ("engine NF4", "llama.cpp Q4_0")]
        for a, b in pairs:
            if a in best and b in best:
                print(f"| {a} / {b} | " + " | ".join(
                    f"{sb / sa:.2f}x" for sa, sb in zip(best[a], best[b], strict=True)) + " |")
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
