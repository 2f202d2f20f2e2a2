"""Where a packed 4-bit CPU kernel stops paying: per-shape kernel call against a dense matmul.

    PYTHONPATH=. python benchmarks/engine/cpu_small_matrices.py --threads 1
    PYTHONPATH=. python benchmarks/engine/cpu_small_matrices.py --narrow --threads 1   # 16-bit routers
    PYTHONPATH=. python benchmarks/engine/cpu_small_matrices.py --blocked --threads 1  # 16-bit layouts

A 4-bit kernel saves weight bytes; below some matrix size there are no bytes worth saving (the
matrix sits in cache) and the kernel's fixed cost per call (casting the activations to bf16 and
back, the packed layout's setup) decides. For each shape N x K and row count M it times, as an
fp32 engine calls them (fp32 activations in, fp32 out): the dense fp32 matmul, the int4 kernel
(``cpu_int4.int4_matmul``, GPTQ/AWQ g128) and, on AVX512-BF16 CPUs, bitsandbytes' NF4 gemv
(``cpu_nf4.nf4_cpu_matmul``). Times are medians of ``--repeats`` calls, interleaved so that load
changes hit every column alike; ratios are kernel / dense (above 1: dense is faster). The engine
dequantizes matrices of at most ``cpu_dense.DENSE_MAX_ELEMENTS`` weights at load
(``kernels/cpu_dense.py``); that threshold comes from this table.

``--narrow`` times the other small-matrix question, for a 16-bit engine: a matrix with few output
rows (a router, [experts, hidden]) in the serving dtype against its fp32 copy with the casts in
and out. ``modeling.linear.NARROW_ROWS`` (matrices of at most that many rows keep an fp32 copy on
a CPU) comes from that table.

``--blocked`` times 16-bit matrices in their row-major layout (``F.linear``) against oneDNN's
blocked layout (``kernels.cpu_blocked``), cycling through enough copies of each shape (320 MB)
that the weights come from memory, as in a decode step of a large model; it prints the weight
bandwidth of both. ``cpu_blocked.BLOCKED_MIN_ELEMENTS`` comes from that table.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch

from thresher.compress.nf4 import nf4_quantize
from thresher.serve_kernels.kernels import cpu_blocked, cpu_nf4
from thresher.serve_kernels.kernels.cpu_dense import DENSE_MAX_ELEMENTS
from thresher.serve_kernels.kernels.cpu_int4 import int4_matmul, pack_int4
from thresher.serve_kernels.modeling.linear import NARROW_ROWS

NARROW = ["8x1024", "8x2048", "16x2048", "60x2048", "64x4096", "128x1024", "128x2048",
          "256x1024"]
BLOCKED = ["512x256", "256x1024", "512x512", "1024x1024", "1536x1024", "1024x2048", "4096x1024",
           "4096x4096"]
SHAPES = ["128x128", "256x128", "256x256", "512x256", "512x512", "1024x512", "1024x1024",
          "2048x1024", "4096x1024"]


def medians(fns: list, repeats: int) -> list[float]:
    """Median ms of each function, the calls interleaved."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--narrow", action="store_true",
                    help="16-bit narrow matrices against their fp32 copy (default shapes: routers)")
    ap.add_argument("--blocked", action="store_true",
                    help="16-bit row-major against oneDNN's blocked layout, weights from memory")
    ap.add_argument("--dtype", default="bfloat16", help="the 16-bit dtype of --narrow/--blocked")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.blocked:
        blocked(args.shapes if args.shapes != SHAPES else BLOCKED, args.rows + [256],
                getattr(torch, args.dtype))
        return
    if args.narrow:
        narrow(args.shapes if args.shapes != SHAPES else NARROW, args.rows, args.repeats,
               getattr(torch, args.dtype))
        return
    nf4 = cpu_nf4.cpu_nf4_available()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}, NF4 kernel {'yes' if nf4 else 'no'}, "
          f"DENSE_MAX_ELEMENTS {DENSE_MAX_ELEMENTS:,}\n")
    print("| N x K | weights | M | fp32 dense ms | int4 ms | int4 / dense | NF4 ms | NF4 / dense |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, generator=gen) * 0.02
        groups = k // 128
        q = torch.randint(0, 16, (k, n), generator=gen)
        scales = torch.rand(groups, n, generator=gen) * 0.01
        zeros = torch.full((groups, n), 8.0)
        pack = pack_int4(q, zeros, scales, torch.arange(k) // 128)
        nf4_pack = cpu_nf4.pack_nf4_cpu(nf4_quantize(w, False, torch.float32)) if nf4 else None
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            fns = [functools.partial(torch.nn.functional.linear, x, w),
                   functools.partial(int4_matmul, x, pack)]
            if nf4_pack is not None:
                fns.append(functools.partial(cpu_nf4.nf4_cpu_matmul, x, nf4_pack))
            t = medians(fns, args.repeats)
            nf4_cols = (f"{t[2]:.4f} | {t[2] / t[0]:.2f}x" if len(t) > 2 else "- | -")
            print(f"| {n} x {k} | {n * k:,} | {m} | {t[0]:.4f} | {t[1]:.4f} | {t[1] / t[0]:.2f}x | "
                  f"{nf4_cols} |")


def narrow(shapes: list[str], rows: list[int], repeats: int, dtype: torch.dtype) -> None:
    """16-bit F.linear against fp32 F.linear with the casts in and out, per shape."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}, NARROW_ROWS {NARROW_ROWS}\n")
    print(f"| N x K | M | {dtype} ms | fp32 copy ms | 16-bit / fp32 copy |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
        w32 = w.float()
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            t = medians([functools.partial(torch.nn.functional.linear, x, w),
                         lambda x=x, w32=w32: torch.nn.functional.linear(x.float(), w32).to(dtype)],
                        repeats)
            print(f"| {n} x {k} | {m} | {t[0]:.4f} | {t[1]:.4f} | {t[0] / t[1]:.2f}x |")


def blocked(shapes: list[str], rows: list[int], dtype: torch.dtype) -> None:
    """Per shape and row count: best-of-3 time per matrix over copies that overflow the cache,
    row-major against blocked, and the weight bandwidth of each."""
    if not cpu_blocked.blocked_supported(dtype):
        raise SystemExit(f"this CPU's oneDNN has no {dtype} matmul")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}, BLOCKED_MIN_ELEMENTS {cpu_blocked.BLOCKED_MIN_ELEMENTS:,}\n")
    print("| N x K | M | row-major us | GB/s | blocked us | GB/s | speedup |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        copies = max(4, min(60, 320 * 2**20 // (n * k * dtype.itemsize)))
        plain = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for _ in range(copies)]
        packed = [cpu_blocked.block(w) for w in plain]
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            a = _per_matrix(lambda w, x=x: torch.nn.functional.linear(x, w), plain)
            b = _per_matrix(lambda w, x=x: cpu_blocked.blocked_matmul(x, w), packed)
            gbs = [n * k * dtype.itemsize / t / 1e3 for t in (a, b)]
            print(f"| {n} x {k} | {m} | {a:.1f} | {gbs[0]:.1f} | {b:.1f} | {gbs[1]:.1f} | "
                  f"{a / b:.2f}x |")


def _per_matrix(fn, weights: list) -> float:
    """Best of three passes over ``weights``: microseconds per call."""
    for w in weights[:3]:
        fn(w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, time.perf_counter() - start)
    return best / len(weights) * 1e6


if __name__ == "__main__":
    main()
