"""The damped inverse-Hessian factor GPTQ's column loop runs on, shared by the quantizers
(compress) and the GGUF block rounding (export), which the layer contract keeps apart."""

from __future__ import annotations

import torch

DAMP_RETRIES = 3  # each retry multiplies the dampening by 10


def damped_inverse_cholesky(H: torch.Tensor, damp_percent: float
                            ) -> tuple[torch.Tensor, float] | None:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 and the dampening it took,
    retrying with 10x more dampening up to ``DAMP_RETRIES`` times; None if every try fails."""
    mean_diag = torch.mean(torch.diag(H))
    eye = torch.eye(H.shape[0], device=H.device)
    for attempt in range(DAMP_RETRIES + 1):
        percent = damp_percent * 10**attempt
        L, info = torch.linalg.cholesky_ex(H + percent * mean_diag * eye)
        if info == 0 and torch.isfinite(L).all():
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info == 0 and torch.isfinite(U).all():
                return U, percent
    return None
