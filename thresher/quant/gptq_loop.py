"""GPTQ's column loop (Frantar et al., arXiv 2210.17323, Algorithm 1), once for every grid.

Columns are rounded left to right; the error of each rounded column, divided by its diagonal
entry of U (the upper Cholesky factor of H^-1), is spread over the columns not yet rounded along
U's row. Updates inside a lazy batch of ``block_size`` columns are applied column by column; the
batch's accumulated errors reach the columns after it in one matrix product.

What a column rounds to is the grid's business: ``compress.gptq`` rounds to a uniform grid per
(row, group), fitted up front or when the loop reaches the group, and ``export.block_gptq`` to
the fixed per-value grids of llama.cpp's block types. Both hand the loop a ``ColumnGrid``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch


class ColumnGrid(Protocol):
    def round(self, col: int, w: torch.Tensor,
              ahead: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The values that column ``col`` (its current weights ``w`` [..., rows]) rounds to,
        keeping whatever the caller needs (codes, scales); ``ahead(n)`` gives the current weights
        of columns col .. col + n - 1, for a grid fitted when the loop reaches it."""
        ...


def gptq_sweep(W: torch.Tensor, U: torch.Tensor, grid: ColumnGrid, block_size: int = 128,
               losses: torch.Tensor | None = None) -> None:
    """Round every column of ``W`` [..., rows, cols] through ``grid`` with GPTQ's error feedback
    on the factor ``U`` [..., cols, cols]; ``W`` itself is left as is. With ``losses`` [...,
    rows], each row's proxy loss sum((w - q)^2 / U_jj^2 / 2) is added to it.

    Leading dimensions are a batch of independent matrices of one shape (a layer's experts): the
    loop's few operations per column then run once for all of them, which is what a GPU needs
    (per matrix, a 2048-column weight is ~30,000 kernel launches) and what small matrices on a
    CPU need too."""
    W = W.clone()
    cols = W.shape[-1]
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[..., i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[..., i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[..., i]
            q = grid.round(i1 + i, w, partial(_ahead, W1, W, i, i2))
            d = U1[..., i, i].unsqueeze(-1)
            if losses is not None:
                losses += (w - q) ** 2 / d**2 / 2
            err = (w - q) / d
            W1[..., i:] -= err.unsqueeze(-1) @ U1[..., i, i:].unsqueeze(-2)
            Err1[..., i] = err
        W[..., i2:] -= Err1 @ U[..., i1:i2, i2:]


def _ahead(W1: torch.Tensor, W: torch.Tensor, i: int, i2: int, n: int) -> torch.Tensor:
    """The current weights of ``n`` columns from column ``i`` of the lazy batch ``W1`` on, past
    the batch's end into ``W`` (which the batch's errors have not reached yet)."""
    return torch.cat([W1[..., i:], W[..., i2:]], dim=-1)[..., :n]
