"""Per-channel 8-bit GPTQ matmuls on the CPU through torch's ``_weight_int8pack_mm``.

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
