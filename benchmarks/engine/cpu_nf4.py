"""NF4 matmul on the CPU: bitsandbytes' native gemv against dequantize-then-matmul and bf16.

    PYTHONPATH=. python benchmarks/engine/cpu_nf4.py --threads 2

For each shape (the random MoE of ``cpu_decode.py``: an expert's gate|up 4096 x 1024 and down
1024 x 2048, and a 4096 x 4096 matrix) and row count M, the best of ``--repeats`` wall times of
x [M, K] @ W.T: the bf16 dense matmul, the NF4 gemv on weights repacked at load
(``kernels.cpu_nf4``), bitsandbytes' native dequantization to bf16 (a new tensor a call) followed
by the dense matmul, thresher's C dequantization (``thr_nf4_dequant``, same bits) into a reused
buffer followed by the same matmul (``cpu_blocked.dequantized_matmul``), and ``nf4_cpu_matmul``
as the engine calls it. The row count from which it switches from the gemv to dequantizing
(``dequantize_rows``) comes from this table. Prints one table, times in ms, ratios to bf16.

``--fp32`` times instead what CPUs without bitsandbytes' kernel (no AVX512-BF16) run: the
dequantizing reference (``kernels.nf4.nf4_matmul_ref``, W rebuilt in torch each call) against
``cpu_nf4.nf4_fp32_matmul`` (the same fp32 arithmetic, W from thresher's C pass into a reused
buffer) and the fp32 dense matmul; this machine's bitsandbytes is not needed for it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from thresher.compress.nf4 import nf4_quantize
from thresher.serve_kernels.kernels import cpu_blocked, cpu_native, cpu_nf4
from thresher.serve_kernels.kernels.nf4 import nf4_matmul_ref


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def time_row(x: torch.Tensor, dense: torch.Tensor, pack: cpu_nf4.NF4Pack, repeats: int
             ) -> tuple[float, float, float, float, float]:
    """(bf16, NF4 gemv, bitsandbytes' dequantize + bf16, thresher's dequantize + bf16, as
    served) ms of x @ W.T."""
    bnbf = cpu_nf4.bitsandbytes_functional()
    n = pack.out_features
    return (best_ms(lambda: x @ dense.T, repeats),
            best_ms(lambda: bnbf.gemv_4bit(x, pack.weight, state=pack.state), repeats),
            best_ms(lambda: x @ bnbf.dequantize_4bit(pack.published, pack.dense_state).T,
                    repeats),
            best_ms(lambda: cpu_blocked.dequantized_matmul(
                x, n, lambda n0, n1, buf: cpu_nf4.dequantize(pack, n0, n1, buf)), repeats),
            best_ms(lambda: cpu_nf4.nf4_cpu_matmul(x, pack), repeats))


def time_fp32_row(x: torch.Tensor, dense: torch.Tensor, nf4, repeats: int
                  ) -> tuple[float, float, float]:
    """(fp32 dense, reference, thresher's fp32 pass) ms of x @ W.T."""
    return (best_ms(lambda: x @ dense.T, repeats),
            best_ms(lambda: nf4_matmul_ref(x, nf4), repeats),
            best_ms(lambda: cpu_nf4.nf4_fp32_matmul(x, nf4), repeats))


def fp32_table(shapes: list[str], rows: list[int], repeats: int) -> None:
    """The reference against the C pass's fp32 matmul (``--fp32``)."""
    print("| N x K | M | fp32 dense ms | reference ms | thresher fp32 pass ms | reference / pass |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        nf4 = nf4_quantize(w, False, torch.float32)
        dense = nf4.dequantize_fp32()
        for m in rows:
            dense_ms, ref, own = time_fp32_row(torch.randn(m, k), dense, nf4, repeats)
            print(f"| {n} x {k} | {m} | {dense_ms:.3f} | {ref:.3f} | {own:.3f} | "
                  f"{ref / own:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x1024", "1024x2048", "4096x4096"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 512])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fp32", action="store_true",
                    help="the reference against thresher's fp32 pass (CPUs without AVX512-BF16)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fp32:
        if cpu_native.library() is None:
            raise SystemExit("thresher's C kernels do not build here")
        print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}\n")
        fp32_table(args.shapes, args.rows, args.repeats)
        return
    if not cpu_nf4.cpu_nf4_available() or cpu_native.library() is None:
        raise SystemExit("needs bitsandbytes' CPU NF4 kernel (AVX512-BF16) and thresher's C kernels")
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}\n")
    print("as served: the gemv below cpu_nf4.dequantize_rows(N * K) rows, the dequantized "
          f"weight from there ({cpu_nf4.dequantize_rows(1)} rows for small matrices here)\n")
    print("| N x K | M | bf16 ms | NF4 gemv ms | gemv / bf16 | bitsandbytes dequantize + bf16 ms "
          "| thresher dequantize + bf16 ms | thresher dequantize / bf16 | as served ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        dense = w.to(torch.bfloat16)
        pack = cpu_nf4.pack_nf4_cpu(nf4_quantize(w, False, torch.float32))
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            bf16, gemv, bnb, own, served = time_row(x, dense, pack, args.repeats)
            print(f"| {n} x {k} | {m} | {bf16:.3f} | {gemv:.3f} | {gemv / bf16:.2f}x | {bnb:.3f} "
                  f"| {own:.3f} | {own / bf16:.2f}x | {served:.3f} |")


if __name__ == "__main__":
    main()
