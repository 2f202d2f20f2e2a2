"""CPU greedy decode: a memory-bound random Qwen3-MoE in 16 bits against its 4-bit artifacts.

    python benchmarks/cpu_decode.py                   # 10 layers, about 1.1 GB in bf16
    python benchmarks/cpu_decode.py --layers 4        # smaller, for a loaded machine

Run it from the repository root with ``PYTHONPATH=.`` when the editable install points at
another checkout.

Builds the checkpoint of ``quant_scale`` (hidden 1024, 8 experts of 2048, top-2) on disk,
quantizes it with thresher (RTN: GPTQ's format without the calibration time; AWQ with a few
calibration samples), and times greedy decode through the engine for each variant at each
concurrency: decode tokens per second = new tokens / (time of N+1 tokens - time of 1 token), so
prefill is left out. Bandwidth use = weight bytes one decode step reads per sequence (attention,
router, top-k of the experts, lm_head; the packed bytes a 4-bit layer's kernel reads) x tokens/s
at concurrency 1, against a 512 MB copy (read + write bytes) timed in the same run. Prints a
table; the files are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from quant_scale import build_checkpoint

from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.modeling.linear import DenseLinear
from thresher.serve_kernels.modeling.moe import FusedExperts

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 400, 12, 3, 250, 61, 8, 99, 150, 31]
QUANTIZE = {
    "gptq4": ["--method", "rtn", "--bits", "4", "--group-size", "128"],
    "awq4": ["--method", "awq", "--bits", "4", "--group-size", "128", "--samples", "4",
             "--seq-len", "64"],
    "nf4": ["--method", "nf4"],  # no CPU kernel: the dequantizing reference, for the ratio
}


def copy_bandwidth(mb: int = 512) -> float:
    """Bytes per second a large tensor copy moves (read + write), best of five."""
    src = torch.ones(mb << 18)  # fp32: mb MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def bytes_per_token(llm: LLM) -> int | None:
    """Weight bytes one decode step reads for one sequence (see the module docstring); None when
    a layer runs a dequantizing reference, whose traffic is not its weight bytes."""
    model = llm.engine.runner.model
    total = 0
    for m in model.modules():
        if isinstance(m, FusedExperts):
            if m.format != "dense" and not m.cpu_packs:
                return None
            full = (sum(p.nbytes for p in m.cpu_packs) if m.cpu_packs else
                    sum(b.numel() * b.element_size() for b in m.buffers()))
            experts = m.gate_up_weight.shape[0]
            total += full * model.layers[0].mlp.top_k // experts
        elif isinstance(m, DenseLinear):
            total += m.weight.numel() * m.weight.element_size()
        elif getattr(m, "cpu_packs", None):
            total += sum(p.nbytes for p in m.cpu_packs)
        elif hasattr(m, "qweight") or hasattr(m, "nf4"):
            return None
    return total


def decode_rate(llm: LLM, concurrency: int, new_tokens: int) -> float:
    """Decode tokens per second over ``concurrency`` sequences, prefill subtracted."""
    prompts = [[(t + i) % 4000 for t in PROMPT] for i in range(concurrency)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    run(2)  # warm up
    return concurrency * new_tokens / (run(new_tokens + 1) - run(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="engine dtypes of the 16-bit model")
    ap.add_argument("--formats", nargs="+", default=["gptq4", "awq4"], choices=list(QUANTIZE))
    ap.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="build here and keep; a model or artifact already there is reused")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's; 1 on a shared, loaded machine)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    root = args.workdir or Path(tempfile.mkdtemp(prefix="thresher-cpu-decode-", dir=args.dir))
    keep = args.keep or args.workdir is not None
    try:
        src = root / "model"
        if not (src / "config.json").is_file():
            build_checkpoint(src, args.layers, args.hidden, args.experts, args.intermediate,
                             args.top_k)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        variants = [(f"16-bit ({d})", src, d) for d in args.dtypes]
        for fmt in args.formats:
            out = root / fmt
            variants.append((fmt, out, "float32"))
            if (out / "config.json").is_file():
                continue
            cmd = [sys.executable, "-m", "thresher", "quantize", "--model", str(src),
                   "--out", str(out), *QUANTIZE[fmt]]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
                raise SystemExit(f"quantize {fmt} failed with exit status {proc.returncode}")
        bandwidth = copy_bandwidth()
        rows = []
        for name, path, dtype in variants:
            try:
                llm = LLM(path, dtype=dtype, max_num_seqs=max(args.concurrency))
                rates = [decode_rate(llm, c, args.tokens) for c in args.concurrency]
            except Exception as exc:  # a dtype the engine cannot serve yet is reported, not fatal
                rows.append((name, None, [], f"{type(exc).__name__}: {str(exc)[:60]}"))
                continue
            rows.append((name, bytes_per_token(llm), rates, ""))
            del llm
        base = next((r[2] for r in rows if r[2]), None)
        print(f"\nrandom-init qwen3_moe, {args.layers} layers, hidden {args.hidden}, "
              f"{args.experts} experts x {args.intermediate} (top-{args.top_k}): {size / 1e9:.2f} GB "
              f"in bf16; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads; copy bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s; ratios to the first 16-bit row\n")
        head = " | ".join(f"c={c} tok/s | c={c} ratio" for c in args.concurrency)
        print(f"| variant | MB read / token | {head} | bandwidth use (c=1) | note |")
        print("|---|---|" + "---|---|" * len(args.concurrency) + "---|---|")
        for name, per_token, rates, note in rows:
            if rates:
                cells = " | ".join(f"{r:.2f} | {r / b:.2f}x" for r, b in zip(rates, base, strict=True))
            else:
                cells = " | ".join("-" for _ in range(2 * len(args.concurrency)))
            use = f"{per_token * rates[0] / bandwidth:.1%}" if rates and per_token else "-"
            mb = f"{per_token / 2**20:.0f}" if per_token else "-"
            print(f"| {name} | {mb} | {cells} | {use} | {note} |")
    finally:
        if keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
