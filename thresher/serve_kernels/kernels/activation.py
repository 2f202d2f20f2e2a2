"""SiLU-and-multiply, the gated MLP activation: [..., 2I] -> silu(x[..., :I]) * x[..., I:].

Fusing it saves writing and re-reading the [tokens, 2I] gate/up output between two elementwise
ops. Gate first, up second, as in a fused ``gate_up_proj`` (transformers 5, vLLM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thresher.serve_kernels.kernels.backend import launcher, use_triton

BLOCK = 1024


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter).contiguous()
    out = torch.empty(x2.shape[0], inter, device=x.device, dtype=x.dtype)
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(inter, BLOCK))
        launcher(_silu_and_mul_kernel, x)[grid](x2, out, inter, BLOCK=BLOCK)
    return out.reshape(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] along the last dim, on the selected backend."""
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)
