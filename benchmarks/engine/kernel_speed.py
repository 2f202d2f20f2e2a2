"""W4A16 GEMV (M=1, the decode case) bandwidth: Triton kernels vs. their PyTorch references.

Decode at batch 1 is bound by reading the weights, so the figure of merit is achieved bandwidth
(packed weight + scales + zeros + activations bytes per second) as a fraction of what a plain
device copy reaches on the same machine. Needs a CUDA GPU for the Triton kernels; on a CPU it
says so and times the references only.

    python benchmarks/engine/kernel_speed.py
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from thresher.serve_kernels.kernels import w4a16

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N)
GROUP = 128


def timed(fn, device: str) -> float:
    """Median seconds per call."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write) of 1 GiB (256 MiB on a CPU)."""
    src = torch.empty(2**30 if device == "cuda" else 2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device)


def gptq_inputs(k: int, n: int, device: str):
    qweight = torch.randint(-2**31, 2**31, (k // 8, n), dtype=torch.int32, device=device)
    qzeros = torch.randint(-2**31, 2**31, (k // GROUP, n // 8), dtype=torch.int32, device=device)
    scales = torch.rand(k // GROUP, n, dtype=torch.float16, device=device) * 1e-2
    g_idx = (torch.arange(k, device=device) // GROUP).int()
    return qweight, qzeros, scales, g_idx


def awq_inputs(k: int, n: int, device: str):
    qweight = torch.randint(-2**31, 2**31, (k, n // 8), dtype=torch.int32, device=device)
    qzeros = torch.randint(-2**31, 2**31, (k // GROUP, n // 8), dtype=torch.int32, device=device)
    scales = torch.rand(k // GROUP, n, dtype=torch.float16, device=device) * 1e-2
    return qweight, qzeros, scales


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("No CUDA GPU: the Triton kernels need one; timing the PyTorch references only.")
    peak = copy_bandwidth(device)
    print(f"device copy bandwidth: {peak / 1e9:.0f} GB/s ({device})\n")
    print(f"{'kernel':<6} {'impl':<7} {'K x N':>12} {'us':>10} {'GB/s':>8} {'of copy':>8}")
    for k, n in SHAPES if device == "cuda" else SHAPES[:1]:
        x = torch.randn(1, k, dtype=torch.float16, device=device)
        gptq, awq = (x, *gptq_inputs(k, n, device)), (x, *awq_inputs(k, n, device), GROUP)
        impls = [("gptq", "torch", w4a16.gptq_matmul_ref, gptq),
                 ("awq", "torch", w4a16.awq_matmul_ref, awq)]
        if device == "cuda":
            impls += [("gptq", "triton", w4a16.gptq_matmul_triton, gptq),
                      ("awq", "triton", w4a16.awq_matmul_triton, awq)]
        for kernel, impl, fn, args in impls:
            seconds = timed(partial(fn, *args), device)
            nbytes = sum(t.numel() * t.element_size() for t in args if torch.is_tensor(t))
            bandwidth = (nbytes + 2 * n) / seconds  # + the fp16 output
            print(f"{kernel:<6} {impl:<7} {f'{k}x{n}':>12} {seconds * 1e6:>10.1f} "
                  f"{bandwidth / 1e9:>8.1f} {bandwidth / peak:>8.1%}")

if __name__ == "__main__":
    main()
