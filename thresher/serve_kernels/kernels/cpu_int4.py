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

Where thresher's own kernel compiles (``cpu_q4``: int8 activations on the integer units; from
memory 1.1-1.3x torch's kernel for one row, 1.1-1.8x for 16, benchmarks/engine/cpu_q4_matmul.py), a pack
holds its layout instead (``kernel="q4"``); its groups are the weight's own, so any group of 32
or a multiple of 64 rows fits, and N needs no multiple of 16.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from thresher.formats.awq import AWQ
from thresher.formats.base import CheckpointFormat
from thresher.formats.gptq import GPTQ
from thresher.serve_kernels.kernels import cpu_q4

KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes the kernel accepts, largest first
Q4_DTYPES = (torch.float32, torch.bfloat16)  # activations cpu_q4 reads as they are


@dataclass
class Int4Pack:
    """One weight [N, K] in a CPU kernel's layout."""

    weight: torch.Tensor  # uint8 [N, K/2]: _convert_weight_to_int4pack_for_cpu's, or cpu_q4's
    scales_zeros: torch.Tensor  # torch: bf16 [K/group_size, N, 2]; q4: fp32 [N, 2, K/group_size]
    group_size: int
    perm: torch.Tensor | None  # input-row order the weight was packed in (act-order), or None
    kernel: str = "torch"  # "torch" (_weight_int4pack_mm_for_cpu) or "q4" (cpu_q4)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = (self.weight, self.scales_zeros, self.perm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def default_kernel() -> str:
    """cpu_q4 where it compiled on this machine and ``THRESHER_CPU_NATIVE`` is not "off" (read at
    each load, so one process can hold both), else torch's kernel."""
    return "torch" if cpu_q4.library() is None else "q4"


def pack_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor, kernel: str | None = None) -> Int4Pack | None:
    """The CPU layout of W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] with g = g_idx[k];
    None when no kernel can hold it exactly (groups of unequal size; for torch's kernel also N
    not a multiple of 16 or a group size no kernel group divides). ``kernel``: "q4", "torch", or
    None for ``default_kernel()``; a weight q4 cannot hold goes to torch's kernel."""
    k, n = q.shape
    g_idx = g_idx.long()
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):
        perm = torch.argsort(g_idx, stable=True)
        q, g_idx = q[perm], g_idx[perm]
    groups = int(g_idx[-1]) + 1
    if k % groups or not torch.equal(g_idx, torch.arange(k) // (k // groups)):
        return None
    rows = k // groups
    if (kernel or default_kernel()) == "q4" and cpu_q4.supports(k, rows):
        sz = cpu_q4.scales_zeros(scales[:groups], zeros[:groups])
        return Int4Pack(cpu_q4.pack_codes(q), sz, rows, perm, kernel="q4")
    kernel_group = next((g for g in KERNEL_GROUPS if rows % g == 0), None)
    if kernel_group is None or n % 16:
        return None
    repeat = rows // kernel_group
    s = scales.float()[:groups].repeat_interleave(repeat, 0)
    z = zeros[:groups].float().repeat_interleave(repeat, 0)
    scales_zeros = torch.stack([s, (8 - z) * s], dim=-1).to(torch.bfloat16).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.contiguous().int(), 1)
    return Int4Pack(weight, scales_zeros, kernel_group, perm)


def pack_checkpoint_int4(fmt: CheckpointFormat, tensors: Mapping[str, torch.Tensor],
                         group_size: int, kernel: str | None = None) -> Int4Pack | None:
    """A 4-bit tensor set of an integer-grid checkpoint format in the CPU layout (see
    ``pack_int4``), unpacked by the format itself."""
    qw = fmt.unpack(tensors, 4, group_size)
    return pack_int4(qw.codes.T.int().contiguous(), qw.zeros.T.contiguous(), tensors["scales"],
                     qw.g_idx, kernel)


def pack_gptq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor, kernel: str | None = None) -> Int4Pack | None:
    """A GPTQ v1 4-bit tensor set in the CPU layout."""
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    return pack_checkpoint_int4(GPTQ, tensors, -1, kernel)


def pack_awq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, kernel: str | None = None) -> Int4Pack | None:
    """An AWQ gemm tensor set in the CPU layout."""
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return pack_checkpoint_int4(AWQ, tensors, group_size, kernel)


def int4_matmul(x: torch.Tensor, pack: Int4Pack) -> torch.Tensor:
    """x @ W for x [..., K] on the CPU kernel, returned in x's dtype."""
    if pack.kernel == "q4":
        if x.dim() == 2 and pack.perm is None and x.is_contiguous() and x.dtype in Q4_DTYPES:
            return cpu_q4.matmul(x, pack.weight, pack.scales_zeros, pack.group_size)
        x2 = x.reshape(-1, x.shape[-1])
        if pack.perm is not None:
            x2 = x2[:, pack.perm]
        x2 = x2.contiguous() if x2.dtype in Q4_DTYPES else x2.float().contiguous()
        y = cpu_q4.matmul(x2, pack.weight, pack.scales_zeros, pack.group_size)
        return y.to(x.dtype).reshape(*x.shape[:-1], pack.out_features)
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
