"""thresher's own 4-bit CPU matmul (cpu_q4.c): integer dot products on int8 activations.

torch's ``_weight_int4pack_mm_for_cpu`` converts every 4-bit code to bf16 and multiplies in
floating point: about 16 G multiply-adds per second per core here, so a 4-bit decode step is
bound by that arithmetic, not by memory (it reads 8 GB/s per core of packed weights while one
core streams about 9). llama.cpp's Q4_0 matmul instead rounds the activations to int8 per block
of 32 and multiplies on the integer units; cpu_q4.c does the same for GPTQ and AWQ weights
(asymmetric, any group of 32 or a multiple of 64), with AVX512-VNNI where the CPU has it and
AVX2 otherwise, and prefetches the weight rows ahead of the dot products. The activation
rounding adds an error of the size of bf16's (see tests). Built and loaded by ``cpu_native``.
"""

from __future__ import annotations

import torch

from thresher.serve_kernels.kernels.cpu_native import library, loaded

BLOCK = 32  # activation block (one int8 scale each)

__all__ = ["BLOCK", "library", "matmul", "pack_codes", "scales_zeros", "supports"]


def supports(k: int, group_size: int) -> bool:
    """Whether the kernel holds a [*, k] weight with groups of ``group_size`` input rows."""
    return k % 64 == 0 and k % group_size == 0 and (group_size == 32 or group_size % 64 == 0)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the kernel's layout from codes [K, N] in 0..15: per row, chunks of 64
    codes, byte j of a chunk holding code j (low nibble) and code 32 + j (high nibble)."""
    k, n = q.shape
    chunks = q.T.to(torch.uint8).reshape(n, k // 64, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def scales_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2, groups]: per row the group scales s, then s * z, from per-group scales
    and zeros [groups, N]."""
    s, z = scales.float(), zeros.float()
    return torch.stack([s.T, (s * z).T], dim=1).contiguous()


def matmul(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor,
           group_size: int) -> torch.Tensor:
    """x [M, K] (fp32 or bf16, contiguous) @ W.T -> [M, N] in x's dtype; the weight packed by
    ``pack_codes`` once ``library()`` has loaded."""
    lib = loaded()
    assert lib is not None, "cpu_q4 is not loaded: pack weights after library() returned it"
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    if lib.thr_q4_matmul(x.data_ptr(), bf16, m, k, weight.data_ptr(), sz.data_ptr(), n,
                         group_size, y.data_ptr(), bf16):
        raise MemoryError("cpu_q4: out of memory for the activation buffers")
    return y
