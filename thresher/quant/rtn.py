"""Round-to-nearest: the data-free baseline every calibrated method has to beat, and the grid
fit that AWQ runs on its scaled weights."""

from __future__ import annotations

import torch

from thresher.quant.grid import GridSpec, fit_grid, quantize


def round_to_nearest(w: torch.Tensor, spec: GridSpec,
                     group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8 [rows, cols]), scales and zeros (float32 and int32 [rows, groups]) of ``w``
    with one grid per row and group of input columns (``group_size`` -1: one group per row),
    each weight rounded to the nearest code."""
    rows, cols = w.shape
    gs = cols if group_size == -1 else group_size
    flat = w.float().reshape(rows, cols // gs, gs).reshape(-1, gs)
    scale, zero = fit_grid(flat, spec)
    codes = quantize(flat, scale, zero, spec.maxq).reshape(rows, cols)
    return (codes.to(torch.uint8), scale.reshape(rows, cols // gs),
            zero.reshape(rows, cols // gs).to(torch.int32))
