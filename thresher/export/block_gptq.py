"""GPTQ's rounding into ggml's block grids: Q4_0, Q4_1, Q5_0, Q3_K, Q4_K and Q6_K with the error
of each rounded column compensated in the columns not yet rounded (Frantar et al., arXiv
2210.17323), against the full Hessian H = E[x x^T] of the matrix's inputs.

The importance matrix is H's diagonal: it weights each value's rounding error as if the inputs'
columns were uncorrelated, and on thresher's models it does not beat plain rounding at 3-4 bits.
GPTQ uses the correlations. The grids are fixed first ("static groups"): every block's scale
(and minimum, and a K-quant's sub-block scales) come from the importance-weighted fit of the
float weights that ``block_quants`` makes, then GPTQ's column loop rounds column j of each row to
the nearest value of that row's block grid and spreads the error over the later columns with the
upper Cholesky factor of H^-1 (dampened as thresher's GPTQ dampens it, lazy batches of 128
columns). The chosen codes replace the fit's codes in the blocks, so the file dequantizes to
exactly the weights the loop produced. The loop is ``quant.gptq_loop``'s, the one
``compress.gptq`` runs on its own grids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import gguf
import numpy as np
import torch

from thresher.export.block_quants import QType, code_range, quantize, replace_codes
from thresher.quant.gptq_loop import gptq_sweep
from thresher.quant.hessian import inverse_factor, unit_dead_columns

GPTQ_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q3_K, QType.Q4_K, QType.Q6_K})
DAMP_PERCENT = 0.01  # thresher's GPTQ default (recipe ``damp_percent``)
LAZY_BLOCK = 128
ONE_THREAD_BELOW = 1 << 22  # matrices smaller than this (values) loop on one thread


def gptq_quantize(weights: np.ndarray, qtype: QType, hessian: np.ndarray, *,
                  scales: Literal["imatrix", "plain"] = "imatrix",
                  damp_percent: float = DAMP_PERCENT,
                  block_size: int = LAZY_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``weights`` [rows, C] as ``qtype`` blocks rounded by GPTQ against ``hessian`` [C, C] (the
    inputs' second moment); returns the blocks [rows, bytes per row] and the weights they hold
    (fp32, what ``gguf.quants.dequantize`` gives back). ``scales``: the blocks' scales from the
    fit weighted by H's diagonal (the importance matrix) or from the plain fit."""
    if qtype not in GPTQ_TYPES:
        raise ValueError(f"{qtype.name} has no GPTQ rounding")
    rows, cols = weights.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian has shape {hessian.shape}, expected ({cols}, {cols})")
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    diag = np.diag(hessian).astype(np.float32)
    blocks = quantize(weights, qtype, diag if scales == "imatrix" else None)
    blocks = blocks.reshape(-1, type_bytes)
    step, base = block_grid(blocks, qtype)
    levels, offset = code_range(qtype)
    with _threads_for(rows * cols):
        codes, values = column_loop(torch.from_numpy(weights), torch.from_numpy(hessian).float(),
                                    torch.from_numpy(step.reshape(rows, cols)),
                                    torch.from_numpy(base.reshape(rows, cols)), -offset,
                                    levels - 1 - offset, damp_percent, block_size)
    blocks = replace_codes(blocks, qtype, (codes + offset).reshape(-1, block))
    return blocks.reshape(rows, -1), values


def block_grid(blocks: np.ndarray, qtype: QType) -> tuple[np.ndarray, np.ndarray]:
    """Each value's grid in fitted blocks [N, type bytes]: value = step * (q - offset) + base in
    fp32, the operations ggml's dequantizer makes, so a value from it is the file's value."""
    levels, offset = code_range(qtype)
    n = blocks.shape[0]
    if qtype == QType.Q4_1:
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        return np.repeat(d, 32, axis=1), np.repeat(m, 32, axis=1)
    if qtype == QType.Q4_K:
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        step = d * sc.astype(np.float32)
        base = -(dmin * mn.astype(np.float32))
        return np.repeat(step, 32, axis=1), np.repeat(base, 32, axis=1)
    # symmetric grids: value = step * (q - offset), and the code one above the offset gives step
    ones = np.full((n, gguf.GGML_QUANT_SIZES[qtype][0]), offset + 1, dtype=np.int32)
    step = gguf.quants.dequantize(replace_codes(blocks, qtype, ones), qtype).reshape(n, -1)
    return step.astype(np.float32), np.zeros_like(step, dtype=np.float32)


def output_error(weights: np.ndarray, quantized: np.ndarray, hessian: np.ndarray) -> float:
    """tr((W - Q) H (W - Q)^T): the summed squared error of the matrix's outputs over inputs with
    second moment ``hessian``."""
    diff = torch.from_numpy(np.asarray(weights, np.float32) - np.asarray(quantized, np.float32))
    diff = diff.double()
    return float(((diff @ torch.from_numpy(hessian).double()) * diff).sum())


def column_loop(W: torch.Tensor, H: torch.Tensor, step: torch.Tensor, base: torch.Tensor,
                lo: int, hi: int, damp_percent: float,
                block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's loop over columns with every value's grid fixed: returns the integers (lo..hi) and
    the values step * int + base (fp32, rounded as ggml rounds them)."""
    H = H.clone()
    unit_dead_columns(H)  # a column no calibration input touched: its error costs nothing
    grid = _BlockGrid(step, base, lo, hi)
    gptq_sweep(W, inverse_factor(H, damp_percent, "GGUF GPTQ"), grid, block_size)
    return grid.ints.numpy(), grid.values.numpy()


class _BlockGrid:
    """Each value's fixed grid step * k + base, k in lo..hi; a value whose step is 0 (an all-zero
    block) rounds to k = 0."""

    def __init__(self, step: torch.Tensor, base: torch.Tensor, lo: int, hi: int):
        self.step, self.base, self.lo, self.hi = step, base, lo, hi
        self.live = step != 0
        self.safe = torch.where(self.live, step, torch.ones_like(step))
        self.ints = torch.zeros(step.shape, dtype=torch.int32)
        self.values = torch.zeros(step.shape, dtype=torch.float32)

    def round(self, col: int, w: torch.Tensor,
              ahead: Callable[[int], torch.Tensor]) -> torch.Tensor:
        k = torch.round((w - self.base[:, col]) / self.safe[:, col]).clamp_(self.lo, self.hi)
        k = torch.where(self.live[:, col], k, torch.zeros_like(k))
        q = self.step[:, col] * k + self.base[:, col]
        self.ints[:, col] = k.to(torch.int32)
        self.values[:, col] = q
        return q


@contextmanager
def _threads_for(size: int) -> Iterator[None]:
    """One torch thread for a small matrix: the loop's per-column operations on a few hundred
    values cost more in thread hand-offs than they gain (60x slower on a loaded 2-core CPU)."""
    before = torch.get_num_threads()
    if size < ONE_THREAD_BELOW and before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
