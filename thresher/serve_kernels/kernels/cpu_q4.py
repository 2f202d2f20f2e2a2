"""thresher's own 4-bit CPU matmul (cpu_q4.c): integer dot products on int8 activations.

torch's ``_weight_int4pack_mm_for_cpu`` converts every 4-bit code to bf16 and multiplies in
floating point: about 16 G multiply-adds per second per core here, so a 4-bit decode step is
bound by that arithmetic, not by memory (it reads 8 GB/s per core of packed weights while one
core streams about 9). llama.cpp's Q4_0 matmul instead rounds the activations to int8 per block
of 32 and multiplies on the integer units; cpu_q4.c does the same for GPTQ and AWQ weights
(asymmetric, any group of 32 or a multiple of 64), with AVX512-VNNI where the CPU has it and
AVX2 otherwise, and prefetches the weight rows ahead of the dot products. ``matmul8`` does the
same for 8-bit GPTQ codes, a byte each (llama.cpp's Q8_0 x Q8_0, with GPTQ's zero points). The activation
rounding adds an error of the size of bf16's (see tests). A prefill's many rows are another
matter: the integer kernels' multiply-adds cost the same per row, so from ``DEQUANT_ROWS`` bf16
rows on, where torch's bf16 matmul has AMX tiles, the weight is dequantized to bf16 once per call
(``dequantize``) and multiplied there. Built and loaded by ``cpu_native``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from thresher.serve_kernels.kernels.cpu_blocked import amx_matmul, dequantized_matmul
from thresher.serve_kernels.kernels.cpu_native import library, loaded

BLOCK = 32  # activation block (one int8 scale each)
# From this many activation rows on, a bf16 matmul on AMX tiles over the weight dequantized once
# per call beats the integer kernels, weights from memory: 1.26-1.54x at 32 rows, 1.8-2.4x at 64,
# 2.8-4.1x at 128, 6-8x at 512; 0.99-1.20x at 24 (benchmarks/engine/cpu_q4_matmul.py, one and
# two threads; docs/benchmarks.md "The 4-bit CPU matmul")
DEQUANT_ROWS = 32

__all__ = ["BLOCK", "DEQUANT_ROWS", "ExpertTable", "dequantize", "library", "matmul", "matmul8",
           "pack_codes", "scales_zeros", "supports"]


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
    return _matmul("thr_q4_matmul", x, weight, sz, group_size)


def matmul8(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """x [M, K] (fp32 or bf16, contiguous) @ W.T -> [M, N] in x's dtype for 8-bit codes
    [N, K] (uint8, row-major) with ``scales_zeros``-style scales [N, 2, groups]."""
    return _matmul("thr_q8_matmul", x, codes, sz, group_size)


def dequantize(codes: torch.Tensor, sz: torch.Tensor, k: int, group_size: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in bf16 (w = q * s - s * z, rounded once) from 4-bit codes in ``pack_codes``'s
    layout ([N, K/2]) or 8-bit codes ([N, K]); into ``out`` (bf16, at least N * K) if given."""
    lib = loaded()
    assert lib is not None, "cpu_q4 is not loaded: pack weights after library() returned it"
    n = codes.shape[0]
    bits = 4 if codes.shape[1] * 2 == k else 8
    w = (torch.empty(n * k, dtype=torch.bfloat16) if out is None else out)[: n * k].view(n, k)
    rc = lib.thr_q_dequant(codes.data_ptr(), bits, sz.data_ptr(), n, k, group_size, w.data_ptr())
    if rc:
        raise ValueError(f"cpu_q4: rows of {k} in groups of {group_size} are not held")
    return w


def _matmul(name: str, x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """One of the C matmuls (same arguments): -1 is out of memory, -2 a shape it does not hold.
    ``DEQUANT_ROWS`` or more bf16 rows (a prefill) take the dequantized weight where torch's
    bf16 matmul has AMX tiles."""
    lib = loaded()
    assert lib is not None, "cpu_q4 is not loaded: pack weights after library() returned it"
    m, k = x.shape
    n = codes.shape[0]
    # without AMX tiles the bf16 matmul ran slower than these kernels (110 against 125 G
    # multiply-adds a second on two cores)
    if m >= DEQUANT_ROWS and x.dtype == torch.bfloat16 and amx_matmul():
        return dequantized_matmul(x, n, lambda n0, n1, buf: dequantize(
            codes[n0:n1], sz[n0:n1], k, group_size, buf))
    y = torch.empty(m, n, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    rc = getattr(lib, name)(x.data_ptr(), bf16, m, k, codes.data_ptr(), sz.data_ptr(), n,
                            group_size, y.data_ptr(), bf16)
    if rc == -2:
        raise ValueError(f"cpu_q4: rows of {k} in groups of {group_size} are not held")
    if rc:
        raise MemoryError("cpu_q4: out of memory for the activation buffers")
    return y


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


@dataclass
class ExpertTable:
    """Every expert's gate|up and down weights in cpu_q4's layout, as the C pointer arrays
    ``thr_q4_moe_one`` takes, so one decode token runs its experts in one call. The packs stay
    referenced here: the arrays point into them."""

    packs: tuple[list, list]  # (gate_up, down) Int4Packs, kept alive
    gate_up: tuple[ctypes.Array, ctypes.Array, int]  # weights, scales, group size
    down: tuple[ctypes.Array, ctypes.Array, int]
    hidden: int
    inter: int

    @classmethod
    def build(cls, gate_up: list, down: list) -> ExpertTable | None:
        """The table for packs made by ``cpu_int4.pack_int4`` (None unless every one is a q4
        pack without an input permutation, with one group size per projection)."""
        if loaded() is None:
            return None
        for packs in (gate_up, down):
            if any(p.kernel != "q4" or p.perm is not None for p in packs):
                return None
            if len({p.group_size for p in packs}) != 1:
                return None
        hidden, inter = gate_up[0].weight.shape[1] * 2, down[0].weight.shape[1] * 2
        if gate_up[0].out_features != 2 * inter or down[0].out_features != hidden:
            return None

        def side(packs: list) -> tuple[ctypes.Array, ctypes.Array, int]:
            return (_pointers([p.weight for p in packs]),
                    _pointers([p.scales_zeros for p in packs]), packs[0].group_size)

        return cls((gate_up, down), side(gate_up), side(down), hidden, inter)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for one token x [1, hidden] (fp32 or bf16, contiguous)."""
        ids = topk_ids if topk_ids.dtype == torch.int64 else topk_ids.long()
        weights = topk_weights if topk_weights.dtype in (torch.float32, torch.bfloat16) \
            else topk_weights.float()
        ids, weights = ids.contiguous(), weights.contiguous()
        out = torch.empty(1, self.hidden, dtype=x.dtype)
        rc = loaded().thr_q4_moe_one(
            x.data_ptr(), int(x.dtype == torch.bfloat16), weights.data_ptr(),
            int(weights.dtype == torch.bfloat16), ids.data_ptr(), ids.numel(),
            len(self.packs[0]), self.hidden, self.inter, *self.gate_up, *self.down,
            out.data_ptr())
        if rc == -2:
            raise ValueError(f"expert ids {ids.tolist()} outside [0, {len(self.packs[0])})")
        if rc:
            raise MemoryError("cpu_q4: out of memory for the expert buffers")
        return out
