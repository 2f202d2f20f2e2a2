"""Rotary position embedding, neox / half-rotation style (Llama, Qwen, Mixtral, OLMoE).

For a head vector x = [x1, x2] (halves of head_dim D) at position p:
out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin], i.e. x * cos + rotate_half(x) * sin.
cos and sin come from one cache [max_positions, D] = [cos | sin] (D/2 each) built from the
model's own ``inv_freq`` (so any RoPE scaling the model's config applies is already in it) and
indexed by each token's position, which is what continuous batching needs: tokens of different
sequences sit at unrelated positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thresher.serve_kernels.kernels.backend import launcher, use_triton


def rotary_cos_sin(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> torch.Tensor:
    """The [max_positions, D] fp32 cache [cos | sin] for ``inv_freq`` [D/2]."""
    pos = torch.arange(max_positions, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling


def apply_rotary_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:
    """Rotate x [tokens, heads, D] by the angles at ``positions`` [tokens]."""
    cos, sin = cos_sin[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@triton.jit
def _rotary_kernel(
    x_ptr, positions_ptr, cos_sin_ptr, out_ptr, heads, half,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < half
    cos = tl.load(cos_sin_ptr + pos * 2 * half + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * 2 * half + half + offs_d, mask=mask_d,
                  other=0.0).to(tl.float32)
    offs = token * heads * 2 * half + offs_h[:, None] * 2 * half + offs_d[None, :]
    mask = (offs_h[:, None] < heads) & mask_d[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(out_ptr + offs, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offs + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary_triton(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:
    tokens, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if tokens:
        launcher(_rotary_kernel, x)[(tokens,)](
            x, positions.contiguous(), cos_sin.contiguous(), out, heads, dim // 2,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim // 2),
        )
    return out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, q_heads, D] and k [tokens, kv_heads, D] on the selected backend."""
    rotate = apply_rotary_triton if use_triton(q) else apply_rotary_ref
    return rotate(q, positions, cos_sin), rotate(k, positions, cos_sin)
