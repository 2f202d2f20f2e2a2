"""GPTQ-4 and AWQ-4 matmuls on the CPU through torch's weight-only int4 kernel.

The dequantizing references rebuild the whole fp32 matrix on every call, so on a CPU a 4-bit
model ran many times slower than its 16-bit parent. torch ships a CPU kernel that reads packed
4-bit weights directly (``_weight_int4pack_mm_for_cpu``); each layer's codes are converted to its
layout once, at load time, and decode then reads a quarter of the bf16 bytes.

The kernel computes, per group of ``g`` input rows, w = (q - 8) * scale + zero with bf16 scale
and zero (``scales_and_zeros`` [K/g, N, 2]); GPTQ and AWQ store w = (q - z) * s, so
zero = (8 - z) * s. It accepts groups of 32, 64, 128 or 256 rows and N a multiple of 16: larger
groups (and one group per row) repeat their scale over several kernel groups, which is exact.
Act-order GPTQ (a g_idx that is not sorted) permutes the weight's input rows once at load so that
each group is contiguous, and gathers the activations with the same permutation on every call.

The kernel runs in bf16: fp32 activations are rounded to bf16 for the matmul (its fp32 variant is
exact but slower than the fp32 dense matmul). Against the 4-bit weight's own error this rounding is
small; tests bound it against the fp32 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thresher.serve_kernels.kernels.w4a16 import awq_codes, gptq_codes

KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes the kernel accepts, largest first


@dataclass
class Int4Pack:
    """One weight [N, K] in the CPU kernel's layout."""

    weight: torch.Tensor  # uint8 [N, K/2], from _convert_weight_to_int4pack_for_cpu
    scales_zeros: torch.Tensor  # bf16 [K/group_size, N, 2]
    group_size: int
    perm: torch.Tensor | None  # input-row order the weight was packed in (act-order), or None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = (self.weight, self.scales_zeros, self.perm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor) -> Int4Pack | None:
    """The CPU layout of W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] with g = g_idx[k];
    None when the kernel cannot hold it exactly (N not a multiple of 16, groups of unequal size,
    a group size no kernel group divides)."""
    k, n = q.shape
    if n % 16:
        return None
    g_idx = g_idx.long()
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):
        perm = torch.argsort(g_idx, stable=True)
        q, g_idx = q[perm], g_idx[perm]
    groups = int(g_idx[-1]) + 1
    if k % groups or not torch.equal(g_idx, torch.arange(k) // (k // groups)):
        return None
    rows = k // groups
    kernel_group = next((g for g in KERNEL_GROUPS if rows % g == 0), None)
    if kernel_group is None:
        return None
    repeat = rows // kernel_group
    s = scales.float()[:groups].repeat_interleave(repeat, 0)
    z = zeros[:groups].float().repeat_interleave(repeat, 0)
    scales_zeros = torch.stack([s, (8 - z) * s], dim=-1).to(torch.bfloat16).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.contiguous().int(), 1)
    return Int4Pack(weight, scales_zeros, kernel_group, perm)


def pack_gptq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor) -> Int4Pack | None:
    """A GPTQ v1 4-bit tensor set in the CPU layout (see ``pack_int4``)."""
    q, zeros = gptq_codes(qweight, qzeros)
    return pack_int4(q, zeros, scales, g_idx)


def pack_awq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int) -> Int4Pack | None:
    """An AWQ gemm tensor set in the CPU layout (see ``pack_int4``)."""
    q, zeros = awq_codes(qweight, qzeros)
    k = q.shape[0]
    return pack_int4(q, zeros, scales, torch.arange(k) // (k if group_size == -1 else group_size))


def int4_matmul(x: torch.Tensor, pack: Int4Pack) -> torch.Tensor:
    """x @ W for x [..., K] on the CPU kernel, returned in x's dtype."""
    if x.dim() == 2 and x.dtype == torch.bfloat16 and pack.perm is None and x.is_contiguous():
        # a bf16 decode's every call: the reshapes and casts below would be dispatched no-ops
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack.weight, pack.group_size,
                                                          pack.scales_zeros)
    x2 = x.reshape(-1, x.shape[-1])
    if pack.perm is not None:
        x2 = x2[:, pack.perm]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.to(torch.bfloat16).contiguous(), pack.weight, pack.group_size, pack.scales_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], pack.out_features)
