"""AWQ (Lin et al., arXiv 2306.00978): activation-aware per-channel scaling before quantization.

A weight column that meets large activations matters more. AWQ multiplies such input channels of
the weights by s > 1 (and divides the input by s, folding 1/s into the operation before), so
rounding hurts them less. The scale is s = mean|x|^alpha (or, with duo scaling,
mean|x|^alpha / mean|w|^(1-alpha)), alpha picked from a 20-point grid by the output error of the
quantized block; optionally each group's clipping range is searched too. The functions here work
on tensors and a loss callback; the driver owns the hooks and the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from thresher.quant.grid import GridSpec
from thresher.quant.rtn import quantize_dequantize

N_GRID = 20
MAX_SHRINK = 0.5  # clipping search: shrink the max range down to 1 - 0.5 + 1/20 = 55 %
CLIP_TOKENS = 512  # tokens sampled for the clipping search
CLIP_ELEMENTS = 1 << 22  # weights searched at once (bounds each candidate's temporaries)


@dataclass(frozen=True)
class ScaleChoice:
    scale: torch.Tensor  # [C]
    alpha: float
    loss: float


def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| normalized by its group's max, per input channel [C]."""
    w = torch.cat([x.float() for x in weights], dim=0)
    rows, cols = w.shape
    gs = cols if group_size == -1 else group_size
    g = w.abs().reshape(-1, gs)
    g = g / (g.amax(dim=1, keepdim=True) + 1e-6)
    return g.reshape(rows, cols).mean(dim=0)


def candidate_scale(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float,
                    duo_scaling: bool) -> torch.Tensor:
    s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 0.0001) if duo_scaling else x_mean.pow(alpha)
    s = s.clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def search_scale(x_mean: torch.Tensor, w_mean: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor], float], duo_scaling: bool = True,
                 n_grid: int = N_GRID) -> ScaleChoice:
    """The candidate with the lowest ``loss_fn(s)`` over alpha in {0, 1/n, ..., (n-1)/n}."""
    best: ScaleChoice | None = None
    for i in range(n_grid):
        alpha = i / n_grid
        s = candidate_scale(x_mean.float(), w_mean.float(), alpha, duo_scaling)
        loss = loss_fn(s)
        if best is None or loss < best.loss:
            best = ScaleChoice(scale=s, alpha=alpha, loss=loss)
    assert best is not None
    return best


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, spec: GridSpec, group_size: int,
                n_grid: int = N_GRID, max_shrink: float = MAX_SHRINK,
                check: torch.Tensor | None = None) -> torch.Tensor:
    """Per (row, group) max |w| (shrunk by 0..45 % in 5 % steps) minimizing the error of the
    group's partial dot products on the sample tokens ``x`` [T, C]. Returns [rows, groups].

    With ``check`` (held-out tokens [T', C]) a group keeps its shrink only where it is no worse
    than the unclipped range on those tokens too: a choice that fits ``x`` alone is undone."""
    rows, cols = w.shape
    gs = cols if group_size == -1 else group_size
    if x.shape[0] == 0 or (check is not None and check.shape[0] == 0):  # no evidence: no shrink
        return w.float().abs().reshape(rows, cols // gs, gs).amax(dim=-1)
    gram = group_gram(x, gs)
    check_gram = None if check is None else group_gram(check, gs)
    step = max(1, CLIP_ELEMENTS // cols)
    return torch.cat([_clip_rows(w[r:r + step].float(), gram, spec, group_size, n_grid,
                                 max_shrink, check_gram) for r in range(0, rows, step)])


def group_gram(x: torch.Tensor, gs: int) -> torch.Tensor:
    """Each column group's second moment over the sample tokens, X_g^T X_g / T: [G, gs, gs].

    The mean squared change of a group's partial dot product under a weight change d is
    d^T H_g d, so the search never forms the [rows, tokens, groups] partial products: it costs
    gs, not T, multiply-adds per weight and candidate, and one pass over the tokens."""
    if x.shape[0] > CLIP_TOKENS:
        x = x[:: x.shape[0] // CLIP_TOKENS][:CLIP_TOKENS]
    t = x.float().reshape(x.shape[0], -1, gs).transpose(0, 1)  # [G, T, gs]
    return t.transpose(1, 2) @ t / x.shape[0]


def group_error(d: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Mean squared partial-output error per (row, group) of weight changes d [rows, G, gs]."""
    dg = d.transpose(0, 1)  # [G, rows, gs]
    return ((dg @ gram) * dg).sum(dim=-1).transpose(0, 1)  # [rows, G]


def _clip_rows(w: torch.Tensor, gram: torch.Tensor, spec: GridSpec, group_size: int,
               n_grid: int, max_shrink: float,
               check_gram: torch.Tensor | None = None) -> torch.Tensor:
    rows, cols = w.shape
    wg = w.reshape(rows, gram.shape[0], gram.shape[1])  # [rows, G, gs]
    org_max = wg.abs().amax(dim=-1, keepdim=True)  # [rows, G, 1]
    best_max = org_max.clone()
    best_err = torch.full_like(org_max, float("inf"))

    def error(max_val: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        clipped = torch.clamp(wg, -max_val, max_val).reshape(rows, cols)
        q = quantize_dequantize(clipped, spec, group_size).reshape(wg.shape)
        return group_error(q - wg, g).unsqueeze(-1)  # [rows, G, 1]

    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        err = error(max_val, gram)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    if check_gram is not None:
        keep = error(best_max, check_gram) <= error(org_max, check_gram)
        best_max = torch.where(keep, best_max, org_max)
    return best_max.reshape(rows, gram.shape[0])


def clip_weight(w: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = w.shape
    gs = cols if group_size == -1 else group_size
    m = max_val.reshape(rows, cols // gs, 1)
    return torch.clamp(w.reshape(rows, cols // gs, gs), -m, m).reshape(rows, cols)
