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

from thresher.compress.rtn import rtn_quantize
from thresher.quant.grid import GridSpec

N_GRID = 20
MAX_SHRINK = 0.5  # clipping search: shrink the max range down to 1 - 0.5 + 1/20 = 55 %
CLIP_TOKENS = 512  # tokens sampled for the clipping search
CLIP_ROWS = 64  # output rows searched at once (bounds the [rows, T, groups] partial products)


@dataclass(frozen=True)
class ScaleChoice:
    scale: torch.Tensor  # [C]
    alpha: float
    loss: float


def pseudo_quantize(w: torch.Tensor, spec: GridSpec, group_size: int) -> torch.Tensor:
    """Quantize-dequantize ``w`` on the min-max grid (the error a scale candidate is judged by)."""
    return rtn_quantize(w, spec, group_size).dequantize()


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

    def groups(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] > CLIP_TOKENS:
            t = t[:: t.shape[0] // CLIP_TOKENS][:CLIP_TOKENS]
        return t.float().reshape(1, t.shape[0], cols // gs, gs)  # [1, T, G, gs]

    xg = groups(x)
    cg = None if check is None else groups(check)
    return torch.cat([_clip_rows(w[r:r + CLIP_ROWS].float(), xg, spec, group_size, n_grid,
                                 max_shrink, cg) for r in range(0, rows, CLIP_ROWS)])


def _partial_products(xg: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    """Each group's partial dot products [rows, T, G] of tokens xg [1, T, G, gs] and weights
    wg [rows, 1, G, gs]: one batched matmul over the groups, not a [rows, T, G, gs] product."""
    return torch.einsum("tgk,rgk->rtg", xg[0], wg[:, 0])


def _group_error(q: torch.Tensor, xg: torch.Tensor, org_out: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the partial dot products per (row, group): [rows, 1, G, 1]."""
    return (_partial_products(xg, q) - org_out).pow(2).mean(dim=1, keepdim=True).unsqueeze(-1)


def _clip_rows(w: torch.Tensor, xg: torch.Tensor, spec: GridSpec, group_size: int, n_grid: int,
               max_shrink: float, check: torch.Tensor | None = None) -> torch.Tensor:
    rows, cols = w.shape
    wg = w.reshape(rows, 1, xg.shape[2], xg.shape[3])  # [rows, 1, G, gs]
    org_max = wg.abs().amax(dim=-1, keepdim=True)  # [rows, 1, G, 1]
    best_max = org_max.clone()
    best_err = torch.full_like(org_max, float("inf"))
    org_out = _partial_products(xg, wg)  # [rows, T, G]

    def quantized(max_val: torch.Tensor) -> torch.Tensor:
        clipped = torch.clamp(wg, -max_val, max_val)
        return pseudo_quantize(clipped.reshape(rows, cols), spec, group_size).reshape(wg.shape)

    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        err = _group_error(quantized(max_val), xg, org_out)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    if check is not None:
        check_out = _partial_products(check, wg)
        keep = _group_error(quantized(best_max), check, check_out) <= _group_error(
            quantized(org_max), check, check_out)
        best_max = torch.where(keep, best_max, org_max)
    return best_max.reshape(rows, xg.shape[2])


def clip_weight(w: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = w.shape
    gs = cols if group_size == -1 else group_size
    m = max_val.reshape(rows, cols // gs, 1)
    return torch.clamp(w.reshape(rows, cols // gs, gs), -m, m).reshape(rows, cols)
