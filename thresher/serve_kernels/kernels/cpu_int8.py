"""8-bit GPTQ matmuls on the CPU: thresher's own kernel (``cpu_q4.matmul8``) where it loads,
else, for per-channel weights, torch's ``_weight_int8pack_mm``.

``Q8Pack`` holds the codes a byte each, row-major, with per-group scales and zeros: any group of
32 or a multiple of 64 (or one per row) whose inputs are in group order, activations rounded to
int8 per block of 32 as the 4-bit kernel's. Where it does not load (no compiler) or the weight
is act-order, the rest of this module:

The kernel computes x @ (w8 * scale[n]).T for an int8 weight [N, K] and one scale per output
channel, so it holds a GPTQ 8-bit weight only when every row has a single group (group size -1).
GPTQ stores W = s * (q - z) with codes q in [0, 255]; with w8 = q - 128 this is
s * w8 + s * (128 - z), whose second term is the same for every input, so
x @ W.T = int8_mm(x, w8, s) + sum(x) * (128 - z) * s, exact in real arithmetic. Grouped 8-bit
weights keep the dequantizing reference. Like the int4 path the kernel runs in bf16 (its fp32
variant is slower than the fp32 dense matmul), so fp32 activations are rounded to bf16 for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thresher.serve_kernels.kernels import cpu_q4


@dataclass
class Q8Pack:
    """One 8-bit weight [N, K] for ``cpu_q4.matmul8``."""

    weight: torch.Tensor  # uint8 [N, K], the codes
    scales_zeros: torch.Tensor  # fp32 [N, 2, groups]: s, then s * z
    group_size: int  # K for one group per row

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_zeros))


def pack_q8(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
            group_size: int) -> Q8Pack | None:
    """W = s * (codes - z) ([N, K] codes, [N, groups] scales and zeros) for thresher's kernel, or
    None where it is not loaded or cannot hold the weight (act-order, or a group or K it does
    not take)."""
    n, k = codes.shape
    g = k if group_size == -1 else group_size
    if cpu_q4.library() is None or not cpu_q4.supports(k, g):
        return None
    if not torch.equal(g_idx.long(), torch.arange(k) // g):
        return None
    return Q8Pack(codes.to(torch.uint8).contiguous(), cpu_q4.scales_zeros(scales.T, zeros.T), g)


def q8_matmul(x: torch.Tensor, pack: Q8Pack) -> torch.Tensor:
    """x @ W.T for x [..., K], returned in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2.contiguous() if x2.dtype in (torch.float32, torch.bfloat16) else x2.float().contiguous()
    y = cpu_q4.matmul8(x2, pack.weight, pack.scales_zeros, pack.group_size)
    return y.to(x.dtype).reshape(*x.shape[:-1], pack.out_features)


@dataclass
class Int8Pack:
    """One per-channel 8-bit weight [N, K] in the kernel's layout."""

    weight: torch.Tensor  # int8 [N, K], the codes minus 128
    scales: torch.Tensor  # bf16 [N]
    offsets: torch.Tensor  # fp32 [N], (128 - z) * s: what each input's sum adds to a channel

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.offsets))


def pack_int8(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              g_idx: torch.Tensor) -> Int8Pack | None:
    """The kernel's form of W = s * (codes - z) ([N, K] codes, [N, groups] scales and zeros), or
    None when a row has more than one group."""
    if bool((g_idx != 0).any()) or scales.shape[1] != 1:
        return None
    s, z = scales[:, 0].float(), zeros[:, 0].float()
    weight = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    return Int8Pack(weight, s.to(torch.bfloat16), (128 - z) * s)


def int8_matmul(x: torch.Tensor, pack: Int8Pack) -> torch.Tensor:
    """x @ W.T for x [..., K], returned in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(x2, pack.weight, pack.scales).float()
    y = y + x2.float().sum(-1, keepdim=True) * pack.offsets
    return y.to(x.dtype).reshape(*x.shape[:-1], pack.weight.shape[0])
