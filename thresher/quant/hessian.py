"""The Hessian of a layer's inputs, H = 2/n * sum(w_t * x_t x_t^T), and the damped inverse
Cholesky factor that GPTQ's column loop runs on.

One ``Hessian`` belongs to one input site: several weights that read the same input (q/k/v, one
expert's gate and up projections) share it. It lives on the device of the activations it is fed.
"""

from __future__ import annotations

import logging
import math

import torch

from thresher.errors import CompressionError

log = logging.getLogger(__name__)

DAMP_RETRIES = 3  # each retry multiplies the dampening by 10


class Hessian:
    """Running H = 2/n * sum(w_t * x_t x_t^T) over the tokens of every batch added."""

    def __init__(self, columns: int, device: torch.device | str = "cpu"):
        self.columns = columns
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.nsamples = 0.0  # sum of token weights seen
        self.weight_sq = 0.0  # sum of squared token weights (for the effective token count)
        self.tokens = 0

    def add_batch(self, x: torch.Tensor, token_weight: torch.Tensor | None = None) -> None:
        """Add inputs ``x`` [T, columns]; ``token_weight`` [T] scales each token's x x^T."""
        x = x.reshape(-1, self.columns).float().to(self.H.device)
        if token_weight is None:
            n = sq = float(x.shape[0])
        else:
            n = float(token_weight.sum())
            sq = float(token_weight.float().pow(2).sum())
            x = x * token_weight.float().to(x.device).sqrt().unsqueeze(1)
        if n <= 0:
            return
        self.H *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        self.weight_sq += sq
        self.tokens += x.shape[0]
        x = math.sqrt(2 / self.nsamples) * x
        self.H += x.T @ x

    @property
    def effective_tokens(self) -> float:
        """Kish's effective sample size (sum w)^2 / sum w^2: the token count when all weights are
        equal, fewer when a few tokens carry most of the weight."""
        return self.nsamples**2 / self.weight_sq if self.weight_sq > 0 else 0.0


def unit_dead_columns(H: torch.Tensor) -> torch.Tensor:
    """Set to 1 the diagonal of the columns no calibration input touched (zero diagonal), in
    place, so H factors; returns their mask. Their rounding error costs nothing."""
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    return dead


def _damped_inverse_cholesky(H: torch.Tensor, damp_percent: float
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


def inverse_factor(H: torch.Tensor, damp_percent: float, name: str) -> torch.Tensor:
    """The factor of ``_damped_inverse_cholesky``, warning when it took more dampening than asked;
    a ``CompressionError`` naming the matrix ``name`` when no dampening makes H factor."""
    factored = _damped_inverse_cholesky(H, damp_percent)
    if factored is None:
        raise CompressionError(
            f"{name}: the GPTQ Hessian is not positive definite even with dampening "
            f"{damp_percent * 10**DAMP_RETRIES:.3g} (calibration activations may contain "
            "inf/nan); check the calibration data or raise damp_percent"
        )
    U, percent = factored
    if percent != damp_percent:
        log.warning("%s: Hessian needed dampening %.3g to factor", name, percent)
    return U
