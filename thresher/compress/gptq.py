"""GPTQ (Frantar et al., arXiv 2210.17323): quantize a weight column by column, compensating the
error of each column in the columns not yet quantized, with the inverse Hessian of the layer's
inputs. Readable beside the paper's Algorithm 1 and IST-DASLab's gptq.py.

One ``GPTQ`` object holds the Hessian of one input site (several weights that read the same input,
e.g. q/k/v, or one expert's gate and up projections, share it). The Hessian and the column loop
live on the weight's device (the layer's, on a GPU), the codes come back there too.
"""

from __future__ import annotations

import logging
import math

import torch

from thresher.compress.quantizer import GridSpec, dequantize, fit_grid, quantize
from thresher.errors import CompressionError
from thresher.formats.quantized import QuantizedWeight
from thresher.models.hessian import DAMP_RETRIES, damped_inverse_cholesky

log = logging.getLogger(__name__)



class GPTQ:
    """Accumulates H = 2/n * sum(w_t * x_t x_t^T) and quantizes weights against it."""

    def __init__(self, columns: int, name: str, device: torch.device | str = "cpu"):
        self.name = name
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

    def _inverse_cholesky(self, H: torch.Tensor, damp_percent: float) -> torch.Tensor:
        """Upper Cholesky factor of (H + damp * I)^-1, retrying with more dampening if needed."""
        factored = damped_inverse_cholesky(H, damp_percent)
        if factored is None:
            raise CompressionError(
                f"{self.name}: the GPTQ Hessian is not positive definite even with dampening "
                f"{damp_percent * 10**DAMP_RETRIES:.3g} (calibration activations may contain "
                "inf/nan); check the calibration data or raise damp_percent"
            )
        U, percent = factored
        if percent != damp_percent:
            log.warning("%s: Hessian needed dampening %.3g to factor", self.name, percent)
        return U

    @torch.no_grad()
    def quantize(self, weight: torch.Tensor, spec: GridSpec, group_size: int = -1,
                 act_order: bool = False, static_groups: bool = True, damp_percent: float = 0.01,
                 block_size: int = 128, diag_shrink: float = 0.0) -> tuple[QuantizedWeight, float]:
        """Quantize ``weight`` [rows, columns]; returns the codes and the summed proxy loss.

        ``diag_shrink`` in [0, 1] blends H toward its diagonal, (1 - r) H + r diag(H), before
        dampening: the correlations of a Hessian seen on few tokens are noise, and at r = 1
        (diagonal H, no error propagated between columns) GPTQ is RTN on the same grid.
        """
        W = weight.detach().float().to(self.H.device, copy=True)
        dev = W.device
        rows, cols = W.shape
        H = self.H.clone()
        if diag_shrink > 0:
            H = (1 - diag_shrink) * H + diag_shrink * torch.diag(torch.diag(H))
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0
        gs = cols if group_size == -1 else group_size
        n_groups = cols // gs

        static: list[tuple[torch.Tensor, torch.Tensor]] = []
        if group_size == -1 or static_groups:  # fit every group up front on the original weights
            static = [fit_grid(W[:, g * gs:(g + 1) * gs], spec) for g in range(n_groups)]

        perm = torch.arange(cols, device=dev)
        if act_order:
            perm = torch.argsort(torch.diag(H), descending=True)
            W, H = W[:, perm], H[perm][:, perm]
        # group of each quantization position: by original column, or by position without static
        pos_group = perm // gs if static else torch.arange(cols, device=dev) // gs
        groups = pos_group.tolist()  # read on the host once, not once a column from the device

        Hinv = self._inverse_cholesky(H, damp_percent)
        codes = torch.zeros_like(W)
        scales = torch.zeros(rows, n_groups, device=dev)
        zeros = torch.zeros(rows, n_groups, device=dev)
        losses = torch.zeros(rows, device=dev)
        scale = zero = None
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            W1 = W[:, i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                g = groups[col]
                if static:
                    scale, zero = static[g]
                elif col % gs == 0:  # a new group: fit on the already-updated weights
                    ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :gs]
                    scale, zero = fit_grid(ahead, spec)
                scales[:, g], zeros[:, g] = scale[:, 0], zero[:, 0]
                w = W1[:, i]
                d = Hinv1[i, i]
                q = quantize(w.unsqueeze(1), scale, zero, spec.maxq)
                codes[:, col] = q[:, 0]
                deq = dequantize(q, scale, zero)[:, 0]
                losses += (w - deq) ** 2 / d**2 / 2
                err = (w - deq) / d
                W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
                Err1[:, i] = err
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

        inv = torch.argsort(perm)
        g_idx = pos_group[inv] if act_order else pos_group
        result = QuantizedWeight(
            codes=codes[:, inv].to(torch.uint8),
            scales=scales,
            zeros=zeros.to(torch.int32),
            g_idx=g_idx.to(torch.int32),
            bits=spec.bits,
            group_size=group_size,
        )
        return result, float(losses.sum())
