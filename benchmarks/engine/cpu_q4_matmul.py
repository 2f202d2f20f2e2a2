"""thresher's 4-bit CPU kernel (cpu_q4) against torch's int4 kernel, weights from memory.

    PYTHONPATH=. python benchmarks/engine/cpu_q4_matmul.py --threads 1
    PYTHONPATH=. python benchmarks/engine/cpu_q4_matmul.py --threads 2 --rows 1 16 128 --shapes 4096x1024

For each shape N x K (GPTQ g128 codes) it packs enough copies of the weight (``--mb`` of packed
bytes, default 320) that a pass over them reads from memory, as a decode step of a large model
does, and times one matmul per copy for each kernel in turn: ``cpu_int4.int4_matmul`` on a torch
pack (``_weight_int4pack_mm_for_cpu``) and on a cpu_q4 pack, bf16 activations of M rows. Best of
``--passes`` passes per kernel (interleaved, so a busy spell of the machine hits both); GB/s is
packed weight bytes per second, to hold against the machine's read bandwidth. "As served" is
the cpu_q4 pack as the engine calls it: from ``cpu_q4.DEQUANT_ROWS`` rows on (a prefill), where
torch's bf16 matmul has AMX tiles, the weight dequantized to bf16 once per call for that matmul.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from thresher.serve_kernels.kernels import cpu_q4
from thresher.serve_kernels.kernels.cpu_int4 import int4_matmul, pack_int4
from thresher.serve_kernels.kernels.cpu_native import library

SHAPES = ["1024x1024", "2560x1024", "4096x1024", "1024x2048", "4096x4096", "14336x4096",
          "4096x14336"]


def packs(n: int, k: int, kernel: str, copies: int) -> list:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (k, n), generator=gen)
    s = torch.rand(k // 128, n, generator=gen) * 0.01 + 1e-3
    z = torch.randint(0, 16, (k // 128, n), generator=gen).float()
    one = pack_int4(q, z, s, torch.arange(k) // 128, kernel)
    assert one is not None and one.kernel == kernel
    # copies of the packed tensors (not views), so each call reads its own bytes
    return [type(one)(one.weight.clone(), one.scales_zeros.clone(), one.group_size, None,
                      one.kernel) for _ in range(copies)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="N x K")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mb", type=int, default=320, help="packed bytes cycled per shape")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if library() is None:
        raise SystemExit("cpu_q4 does not build here (no C compiler, no AVX2, or "
                         "THRESHER_CPU_NATIVE=off): nothing to compare")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu_q4 "
          f"{library().thr_q4_isa().decode()}, load average {os.getloadavg()[0]:.1f}\n")
    print("| N x K | rows | torch int4 us | GB/s | cpu_q4 us | GB/s | speedup | as served us "
          "| served / cpu_q4 |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = cpu_q4.DEQUANT_ROWS
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        nbytes = n * k // 2
        copies = max(2, args.mb * 2**20 // nbytes)
        kernels = {name: packs(n, k, name, copies) for name in ("torch", "q4")}
        kernels["served"] = kernels["q4"]
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(args.passes):
                for name, ps in kernels.items():
                    # cpu_q4's integer kernel at every row count; as served, a prefill's rows
                    # take the weight dequantized to bf16 where torch's matmul has AMX tiles
                    cpu_q4.DEQUANT_ROWS = rows if name == "served" else 1 << 30
                    start = time.perf_counter()
                    for p in ps:
                        int4_matmul(x, p)
                    best[name] = min(best[name], (time.perf_counter() - start) / len(ps))
            cpu_q4.DEQUANT_ROWS = rows
            t, q, s = best["torch"], best["q4"], best["served"]
            print(f"| {shape} | {m} | {t * 1e6:.1f} | {nbytes / t / 1e9:.1f} | {q * 1e6:.1f} | "
                  f"{nbytes / q / 1e9:.1f} | {t / q:.2f}x | {s * 1e6:.1f} | {q / s:.2f}x |",
                  flush=True)
        del kernels


if __name__ == "__main__":
    main()
