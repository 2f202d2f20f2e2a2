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

        grid = _GroupGrid(spec, gs, rows, cols, pos_group.tolist(), static, dev)
        losses = torch.zeros(rows, device=dev)
        gptq_sweep(W, inverse_factor(H, damp_percent, self.name), grid, block_size, losses)

        inv = torch.argsort(perm)
        g_idx = pos_group[inv] if act_order else pos_group
        result = QuantizedWeight(
            codes=grid.codes[:, inv].to(torch.uint8),
            scales=grid.scales,
            zeros=grid.zeros.to(torch.int32),
            g_idx=g_idx.to(torch.int32),
            bits=spec.bits,
            group_size=group_size,
        )
        return result, float(losses.sum())


class _GroupGrid:
    """One uniform grid per (row, group): the ``static`` grids fitted up front, or, without
    them, each group's grid fitted on the already-updated weights when the loop reaches it."""

    def __init__(self, spec: GridSpec, group_size: int, rows: int, cols: int, groups: list[int],
                 static: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device):
        self.spec, self.group_size = spec, group_size
        self.groups = groups  # group of each position, read on the host once
        self.static = static
        self.codes = torch.zeros(rows, cols, device=device)
        self.scales = torch.zeros(rows, cols // group_size, device=device)
        self.zeros = torch.zeros(rows, cols // group_size, device=device)
        self.scale = self.zero = torch.empty(0)

    def round(self, col: int, w: torch.Tensor,
              ahead: Callable[[int], torch.Tensor]) -> torch.Tensor:
        g = self.groups[col]
        if self.static:
            self.scale, self.zero = self.static[g]
        elif col % self.group_size == 0:
            self.scale, self.zero = fit_grid(ahead(self.group_size), self.spec)
        self.scales[:, g], self.zeros[:, g] = self.scale[:, 0], self.zero[:, 0]
        q = quantize(w.unsqueeze(1), self.scale, self.zero, self.spec.maxq)
        self.codes[:, col] = q[:, 0]
        return dequantize(q, self.scale, self.zero)[:, 0]
