"""GPTQ (Frantar et al., arXiv 2210.17323): quantize a weight column by column, compensating the
error of each column in the columns not yet quantized, with the inverse Hessian of the layer's
inputs. Readable beside the paper's Algorithm 1 and IST-DASLab's gptq.py.

One ``GPTQ`` object holds the Hessian of one input site (several weights that read the same input,
e.g. q/k/v, or one expert's gate and up projections, share it). The column loop itself is
``quant.gptq_loop``'s; this module brings the uniform grid per (row, group), act-order and the
diagonal shrink. The Hessian and the loop live on the weight's device (the layer's, on a GPU), the
codes come back there too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from thresher.formats.quantized import QuantizedWeight
from thresher.quant.gptq_loop import gptq_sweep
from thresher.quant.grid import GridSpec, dequantize, fit_grid, quantize
from thresher.quant.hessian import Hessian, inverse_factor, unit_dead_columns


class GPTQ(Hessian):
    """Accumulates H = 2/n * sum(w_t * x_t x_t^T) and quantizes weights against it."""

    def __init__(self, columns: int, name: str, device: torch.device | str = "cpu"):
        super().__init__(columns, device)
        self.name = name

    def quantize(self, weight: torch.Tensor, spec: GridSpec, group_size: int = -1,
                 act_order: bool = False, static_groups: bool = True, damp_percent: float = 0.01,
                 block_size: int = 128, diag_shrink: float = 0.0) -> tuple[QuantizedWeight, float]:
        """Quantize ``weight`` [rows, columns]; returns the codes and the summed proxy loss.

        ``diag_shrink`` in [0, 1] blends H toward its diagonal, (1 - r) H + r diag(H), before
        dampening: the correlations of a Hessian seen on few tokens are noise, and at r = 1
        (diagonal H, no error propagated between columns) GPTQ is RTN on the same grid.
        """
        return quantize_batch([(self, weight, diag_shrink)], spec, group_size, act_order,
                              static_groups, damp_percent, block_size)[0]


@torch.no_grad()
def quantize_batch(items: list[tuple[GPTQ, torch.Tensor, float]], spec: GridSpec,
                   group_size: int = -1, act_order: bool = False, static_groups: bool = True,
                   damp_percent: float = 0.01, block_size: int = 128
                   ) -> list[tuple[QuantizedWeight, float]]:
    """``GPTQ.quantize`` of several weights of one shape at once, each against its own Hessian
    (``items``: Hessian, weight, diag_shrink): one column loop for all of them (``gptq_sweep``
    over a batch), the same codes as one by one."""
    prepared = [_prepare(h, w, spec, group_size, act_order, static_groups, shrink)
                for h, w, shrink in items]
    W = torch.stack([p.W for p in prepared])
    U = torch.stack([inverse_factor(p.H, damp_percent, h.name)
                     for p, (h, _, _) in zip(prepared, items, strict=True)])
    rows, cols = W.shape[1:]
    gs = cols if group_size == -1 else group_size
    grid = _GroupGrid(spec, gs, len(items), rows, cols, [p.pos_group for p in prepared],
                      [p.static for p in prepared] if prepared[0].static else [], W.device)
    losses = torch.zeros(len(items), rows, device=W.device)
    gptq_sweep(W, U, grid, block_size, losses)

    results = []
    for b, p in enumerate(prepared):
        inv = torch.argsort(p.perm)
        g_idx = p.pos_group[inv] if act_order else p.pos_group
        results.append((QuantizedWeight(
            codes=grid.codes[b][:, inv].to(torch.uint8),
            scales=grid.scales[b],
            zeros=grid.zeros[b].to(torch.int32),
            g_idx=g_idx.to(torch.int32),
            bits=spec.bits,
            group_size=group_size,
        ), float(losses[b].sum())))
    return results


class _Prepared(NamedTuple):
    """One weight made ready for the column loop: its dead columns zeroed, its static grids
    fitted on the original weights, weight and Hessian permuted (act-order)."""

    W: torch.Tensor
    H: torch.Tensor
    perm: torch.Tensor
    pos_group: torch.Tensor
    static: list[tuple[torch.Tensor, torch.Tensor]]


def _prepare(h: GPTQ, weight: torch.Tensor, spec: GridSpec, group_size: int, act_order: bool,
             static_groups: bool, diag_shrink: float) -> _Prepared:
    W = weight.detach().float().to(h.H.device, copy=True)
    dev = W.device
    cols = W.shape[1]
    H = h.H.clone()
    if diag_shrink > 0:
        H = (1 - diag_shrink) * H + diag_shrink * torch.diag(torch.diag(H))
    W[:, unit_dead_columns(H)] = 0
    gs = cols if group_size == -1 else group_size

    static: list[tuple[torch.Tensor, torch.Tensor]] = []
    if group_size == -1 or static_groups:  # fit every group up front on the original weights
        static = [fit_grid(W[:, g * gs:(g + 1) * gs], spec) for g in range(cols // gs)]

    perm = torch.arange(cols, device=dev)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    # group of each quantization position: by original column, or by position without static
    pos_group = perm // gs if static else torch.arange(cols, device=dev) // gs
    return _Prepared(W, H, perm, pos_group, static)


class _GroupGrid:
    """One uniform grid per (matrix, row, group): the ``static`` grids fitted up front, or,
    without them, each group's grid fitted on the already-updated weights when the loop reaches
    it. A column's group is the same in every matrix of the batch except with static groups
    under act-order, where each matrix's own permutation decides it (a gather per column)."""

    def __init__(self, spec: GridSpec, group_size: int, batch: int, rows: int, cols: int,
                 groups: list[torch.Tensor], static: list[list[tuple[torch.Tensor, torch.Tensor]]],
                 device: torch.device):
        self.spec, self.group_size = spec, group_size
        shared = all(torch.equal(g, groups[0]) for g in groups[1:])
        self.groups = groups[0].tolist() if shared else None  # read on the host once
        self.group_index = None if shared else torch.stack(groups)  # [batch, cols]
        self.batch = torch.arange(batch, device=device)
        if static:  # [batch, groups, rows]
            self.static_scale = torch.stack([torch.stack([s[:, 0] for s, _ in m]) for m in static])
            self.static_zero = torch.stack([torch.stack([z[:, 0] for _, z in m]) for m in static])
        self.has_static = bool(static)
        self.codes = torch.zeros(batch, rows, cols, device=device)
        self.scales = torch.zeros(batch, rows, cols // group_size, device=device)
        self.zeros = torch.zeros(batch, rows, cols // group_size, device=device)
        self.scale = self.zero = torch.empty(0)

    def round(self, col: int, w: torch.Tensor,
              ahead: Callable[[int], torch.Tensor]) -> torch.Tensor:
        if self.groups is None:  # static groups under act-order: each matrix its own group
            g = self.group_index[:, col]
            self.scale = self.static_scale[self.batch, g]
            self.zero = self.static_zero[self.batch, g]
            self.scales[self.batch, :, g], self.zeros[self.batch, :, g] = self.scale, self.zero
        else:
            g = self.groups[col]
            if self.has_static:
                self.scale, self.zero = self.static_scale[:, g], self.static_zero[:, g]
            elif col % self.group_size == 0:
                block = ahead(self.group_size)
                scale, zero = fit_grid(block.reshape(-1, block.shape[-1]), self.spec)
                self.scale, self.zero = scale.view(w.shape), zero.view(w.shape)
            self.scales[:, :, g], self.zeros[:, :, g] = self.scale, self.zero
        q = quantize(w, self.scale, self.zero, self.spec.maxq)
        self.codes[:, :, col] = q
        return dequantize(q, self.scale, self.zero)
