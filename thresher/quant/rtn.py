"""Round-to-nearest: the data-free baseline every calibrated method has to beat, and the grid
fit that AWQ runs on its scaled weights."""

from __future__ import annotations

import torch

from thresher.quant.grid import GridSpec, dequantize, fit_grid, quantize


def _group_grids(w: torch.Tensor, spec: GridSpec,
                 group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` as one row per (row, group of input columns) in float32, with each one's grid."""
    gs = w.shape[1] if group_size == -1 else group_size
    flat = w.float().reshape(-1, gs)
    scale, zero = fit_grid(flat, spec)
    return flat, scale, zero


def round_to_nearest(w: torch.Tensor, spec: GridSpec,
                     group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8 [rows, cols]), scales and zeros (float32 and int32 [rows, groups]) of ``w``
    with one grid per row and group of input columns (``group_size`` -1: one group per row),
    each weight rounded to the nearest code."""
    rows, cols = w.shape
    flat, scale, zero = _group_grids(w, spec, group_size)
    codes = quantize(flat, scale, zero, spec.maxq).reshape(rows, cols)
    return (codes.to(torch.uint8), scale.reshape(rows, -1), zero.reshape(rows, -1).to(torch.int32))


def quantize_dequantize(w: torch.Tensor, spec: GridSpec, group_size: int) -> torch.Tensor:
    """The weights ``round_to_nearest``'s codes dequantize to, bit for bit, without building
    the codes (what a search judging many candidates needs)."""
    flat, scale, zero = _group_grids(w, spec, group_size)
    return dequantize(quantize(flat, scale, zero, spec.maxq), scale, zero).reshape(w.shape)
