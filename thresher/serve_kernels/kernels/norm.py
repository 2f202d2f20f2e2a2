"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Fused form (as in vLLM's fused_add_rms_norm): residual' = x + residual, rounded to the activation
dtype because that is what the unfused model would hold, and out = rms_norm(residual'), so the
fused and unfused paths agree. Statistics are computed in fp32: y = x / sqrt(mean(x^2) + eps) * w.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from thresher.serve_kernels.kernels.backend import launcher, use_triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch's ``rms_norm``: one call instead of the nine a CPU decode step paid per norm.

    It computes the statistics and the scaling in fp32 for 16-bit inputs and rounds once, as
    the unfused formula does; a 16-bit add likewise rounds the fp32 sum once. ``weight`` is
    [D], or [heads, D] broadcast over x [..., heads, D]."""
    if residual is not None:
        residual = x + residual
        x = residual
    shape = (x.shape[-1],)
    if weight.shape == shape and weight.dtype == x.dtype:
        out = F.rms_norm(x, shape, weight, eps)
    elif weight.shape == shape:
        out = F.rms_norm(x.float(), shape, weight.float(), eps).to(x.dtype)
    else:  # one weight row per head (the joint q|k norm): scale after, still in fp32
        w = weight if weight.dtype == torch.float32 else weight.float()
        out = (F.rms_norm(x.float(), shape, None, eps) * w).to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * hidden
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        x_rounded = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row + offs, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(x2)
    res_in = residual.reshape(-1, hidden).contiguous() if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        launcher(_rms_norm_kernel, x)[(x2.shape[0],)](
            x2, res_in, weight, out, res_out, hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or with ``residual``: (rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
