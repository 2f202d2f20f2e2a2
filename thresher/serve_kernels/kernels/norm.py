"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Fused form (as in vLLM's fused_add_rms_norm): residual' = x + residual, rounded to the activation
dtype because that is what the unfused model would hold, and out = rms_norm(residual'), so the
fused and unfused paths agree. Statistics are computed in fp32: y = x / sqrt(mean(x^2) + eps) * w.
On a CPU the same arithmetic runs as one C call (``cpu_norm.c``) where thresher's C kernels are
loaded: a bf16 [1, 1024] row costs ~10 us there against ~28 us through torch's ``rms_norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from thresher.serve_kernels.kernels import cpu_native
from thresher.serve_kernels.kernels.backend import launcher, use_cpu_kernels, use_triton

C_DTYPES = (torch.float32, torch.bfloat16)  # what cpu_norm.c reads


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


def rms_norm_c(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``rms_norm_ref`` in one C call (cpu_norm.c), or None where it does not apply: no library
    loaded, fp16, non-contiguous tensors, a weight in neither x's dtype nor fp32."""
    lib = cpu_native.loaded()
    d = x.shape[-1]
    if (lib is None or x.dtype not in C_DTYPES or weight.dtype not in (x.dtype, torch.float32)
            or not (x.is_contiguous() and weight.is_contiguous()) or x.is_cuda):
        return None
    if weight.dim() == 1:
        w_rows = 1
    elif x.dim() >= 2 and weight.shape == x.shape[-2:]:
        w_rows = weight.shape[0]  # one weight row per head
    else:
        return None
    if weight.shape[-1] != d:
        return None
    res_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            return None
        res_out = torch.empty_like(x)
    out = torch.empty_like(x)
    lib.thr_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                     None if res_out is None else res_out.data_ptr(), weight.data_ptr(),
                     int(weight.dtype == torch.float32), w_rows, out.data_ptr(), x.numel() // d,
                     d, eps, int(x.dtype == torch.bfloat16))
    return out if res_out is None else (out, res_out)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or with ``residual``: (rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    if use_cpu_kernels(x):
        out = rms_norm_c(x, weight, eps, residual)
        if out is not None:
            return out
    return rms_norm_ref(x, weight, eps, residual)
