"""The uniform min-max grid shared by RTN, GPTQ and AWQ: fit, quantize, dequantize.

A grid maps a weight w to an integer code q in [0, 2^bits - 1] with a scale and a zero point:
q = clamp(round(w / scale) + zero, 0, maxq), w ~ scale * (q - zero). Asymmetric grids span
[min(w), max(w)] (always including 0); symmetric grids span [-max|w|, max|w|] with the zero in
the middle (8 for 4 bits), as GPTQ's reference quantizer does. The MSE search (the reference's
``mse`` option, with squared error in place of its |e|^2.4) tries ranges shrunk toward 0 and keeps
each row's best: clipping a few outliers buys finer steps for the rest. Scales are rounded to fp16
when fitted, because every checkpoint format stores them so: the dequantized weights the driver
computes are then exactly those a loader reconstructs from the artifact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class GridSpec:
    """How to fit a grid: bit width, symmetry, the smallest storable zero point, and whether the
    range is min-max or searched for the least squared error."""

    bits: int
    sym: bool
    min_zero: int = 0  # GPTQ v1 stores zero - 1 unsigned, so it needs zero >= 1
    scale_search: Literal["minmax", "mse"] = "minmax"

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1


MSE_GRID = 100  # shrink steps of 1 % (GPTQ's reference quantizer: grid 100, maxshrink 0.8)
MSE_MAX_SHRINK = 0.8


def fit_grid(w: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero (each [rows, 1]) of the grid of each row of ``w`` [rows, cols]: min-max, or
    with ``scale_search="mse"`` the range shrunk by 0..79 % that rounds the row with the least
    squared error. Shrink 0 is the min-max grid itself, so the search never does worse."""
    w = w.float()
    xmin = w.amin(dim=1).clamp(max=0)
    xmax = w.amax(dim=1).clamp(min=0)
    if spec.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    dead = (xmin == 0) & (xmax == 0)
    xmin = torch.where(dead, -1.0, xmin)
    xmax = torch.where(dead, 1.0, xmax)
    scale, zero = _range_grid(xmin, xmax, spec)
    if spec.scale_search == "mse":
        best = _squared_error(w, scale, zero, spec.maxq)
        for i in range(1, int(MSE_MAX_SHRINK * MSE_GRID)):
            shrink = 1 - i / MSE_GRID
            s, z = _range_grid(shrink * xmin, shrink * xmax, spec)
            err = _squared_error(w, s, z, spec.maxq)
            better = err < best
            best = torch.where(better, err, best)
            scale = torch.where(better, s, scale)
            zero = torch.where(better, z, zero)
    return scale.unsqueeze(1), zero.unsqueeze(1)


def _range_grid(xmin: torch.Tensor, xmax: torch.Tensor,
                spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (rounded to fp16, as stored) and zero point of the grid spanning [xmin, xmax]."""
    scale = ((xmax - xmin) / spec.maxq).half().float().clamp(min=torch.finfo(torch.float16).tiny)
    zero = torch.full_like(scale, (spec.maxq + 1) // 2) if spec.sym else torch.round(-xmin / scale)
    return scale, zero.clamp(spec.min_zero, spec.maxq)


def _squared_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   maxq: int) -> torch.Tensor:
    s, z = scale.unsqueeze(1), zero.unsqueeze(1)
    return (dequantize(quantize(w, s, z, maxq), s, z) - w).pow(2).sum(dim=1)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (as float) of ``w`` on the grid (scale, zero), broadcast along columns."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale * (q - zero)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||w - w_hat||^2 / ||w||^2: the weight-space error reported for every method."""
    w = w.float()
    return float((w - w_hat.float().to(w.device)).pow(2).sum() / w.pow(2).sum().clamp(min=1e-30))
