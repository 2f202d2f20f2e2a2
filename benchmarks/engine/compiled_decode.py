"""CPU decode of one MoE as a compiled graph (torch.compile) against the engine's one-call C step.

    PYTHONPATH=. python benchmarks/engine/compiled_decode.py --threads 2      # the 1.08 GB MoE
    PYTHONPATH=. python benchmarks/engine/compiled_decode.py --layers 2 --hidden 256 \
        --intermediate 256 --workdir /tmp/small-moe                          # quick, small

Why: the engine's CPU decode step was made one native call (``modeling/native_step.py``) to
remove per-operator host time. The other way to remove it is a compiled graph: Inductor fuses
the elementwise work into generated C++ and runs the whole forward as one compiled call. This
script measures that alternative on the same weights: transformers' own forward of the
checkpoint (its ``grouped_mm`` experts, a static KV cache, greedy) eager and under
``torch.compile`` (Inductor's CPU backend, shapes static), beside the engine's C step and its
operator path. The engine's own operator path is not compiled: its C kernels are ctypes calls,
each a graph break.

Tokens/s = new tokens / (time of N + 1 tokens - time of 1 token) at one sequence, prompt left
out; each row's best of ``--repeats`` rounds; the compile time (the first call's) is printed
apart. Prints the copy bandwidth and each row's bandwidth use of the checkpoint's bytes read per
token (the engine's count, ``cpu_decode.bytes_per_token``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_decode import PROMPT, build_checkpoint, bytes_per_token, copy_bandwidth  # noqa: E402

from thresher.serve_kernels import LLM, SamplingParams  # noqa: E402
from thresher.serve_kernels.modeling import native_step  # noqa: E402


def hf_rate(model, tokens: int, repeats: int) -> float:
    """transformers' greedy decode rate (tok/s) with a static cache, prompt left out."""
    ids = torch.tensor([PROMPT])

    def run(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       cache_implementation="static")
        return time.perf_counter() - start

    return max(tokens / (run(tokens + 1) - run(1)) for _ in range(repeats))


def engine_rate(llm: LLM, tokens: int, repeats: int) -> float:
    """The engine's greedy decode rate (tok/s) at one sequence, prompt left out."""

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    return max(tokens / (run(tokens + 1) - run(1)) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each row reports its best")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache/thresher/bench/moe-1g",
                    help="the bf16 checkpoint (built there once: cpu_decode.py's Qwen3-MoE)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    src = args.workdir
    if not (src / "config.json").is_file():
        build_checkpoint(src, args.layers, args.hidden, args.experts, args.intermediate,
                         args.top_k)
    rows: dict[str, float] = {}
    llm = LLM(src, dtype="bfloat16", max_num_seqs=1)
    per_token = bytes_per_token(llm)
    rows["engine C step"] = engine_rate(llm, args.tokens, args.repeats)
    os.environ[native_step.ENV] = "off"
    rows["engine operator path"] = engine_rate(llm, args.tokens, args.repeats)
    os.environ.pop(native_step.ENV)
    del llm
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    model.set_experts_implementation("grouped_mm")
    rows["transformers eager"] = hf_rate(model, args.tokens, args.repeats)
    model.forward = torch.compile(model.forward, dynamic=False)
    start = time.perf_counter()
    hf_rate(model, 2, 1)  # the prompt's and the decode step's graphs compiled
    compile_s = time.perf_counter() - start
    rows["transformers torch.compile"] = hf_rate(model, args.tokens, args.repeats)
    bandwidth = copy_bandwidth()

    size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
    print(f"\n{src.name}: {size:.2f} GB in bf16; {platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; load average {os.getloadavg()[0]:.1f}; compile "
          f"{compile_s:.0f} s\n")
    print("| decode path | c=1 tok/s | ms / token | bandwidth use | / engine C step |")
    print("|---|---|---|---|---|")
    for name, rate in rows.items():
        use = f"{per_token * rate / bandwidth:.1%}" if per_token else "-"
        print(f"| {name} | {rate:.2f} | {1000 / rate:.2f} | {use} | "
              f"{rate / rows['engine C step']:.2f}x |")


if __name__ == "__main__":
    main()
