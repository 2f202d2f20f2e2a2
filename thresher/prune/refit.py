"""Compensation after pruning: refit the kept experts' down projections to the unpruned block.

Removing experts changes a MoE block's output in two ways: the removed experts' contributions
are gone, and their tokens are routed to other experts with other gate values. Both show up on
calibration tokens as a residual between the unpruned block's routed output y(x) and the pruned
block's. Given the pruned routing, the pruned block's routed output is linear in the kept
experts' down projections:

    y_pruned(x) = sum over kept j routed for x of  W_j (g'_j(x) h_j(x))  (+ g'_j(x) b_j)

with h_j(x) = act(gate_j x) * up_j x the input of expert j's down projection, g'_j(x) its gate
among the kept experts and b_j its down bias (gpt-oss; kept as it is). ``refit_down`` solves the ridge least-squares problem

    min over W  sum_x ||y(x) - y_pruned(x)||^2  +  sum_j lambda_j ||W_j - W_j_original||_F^2

by block coordinate descent (one expert's W_j at a time, the others fixed; each step a
Cholesky solve with that expert's Gram matrix, factored once). lambda_j is ``damp`` times the mean
diagonal of expert j's Gram matrix (GPTQ's relative damping), so experts with few tokens stay
near their original weights. Architecture, routing, gates and every other weight are unchanged:
the pruned checkpoint loads wherever the plain pruned one does.

``offset`` adds to the target what the block must also produce for the layer's output to match
the unpruned model's at that depth (``refit_target: model``: the drift that earlier pruned layers
left in the residual stream, measured by the caller on the unpruned and pruned streams).

The idea is the output-reconstruction step of pruning methods for dense layers (OBS/SparseGPT
update the surviving weights to absorb the removed ones) applied to whole experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from thresher.models.adapters import Adapter
from thresher.prune.reconstruction import pruned_routing


@dataclass
class RefitResult:
    """New down projections of one layer's kept experts and how much of the pruning error is left."""

    down: dict[int, torch.Tensor]  # original expert index -> [H, I], the layer's dtype and device
    error_before: float  # sum ||y - y_pruned||^2 / sum ||y||^2 with the original down projections
    error_after: float  # the same with the refit ones (on the tokens fitted)
    tokens: int


def routed_output_full(adapter: Adapter, layer: nn.Module, config, x: torch.Tensor
                       ) -> torch.Tensor:
    """The unpruned block's routed output [T, H] (shared experts excluded), as its forward sums it."""
    routing = adapter.route(layer, x, config)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(routing.probs.shape[1]):
        token, slot = (routing.top_k_index == e).nonzero(as_tuple=True)
        if token.numel():
            weight = routing.top_k_weights[token, slot].float()[:, None]
            y.index_add_(0, token, weight * adapter.expert_forward(layer, e, x[token]).float())
    return y


@torch.no_grad()
def refit_down(adapter: Adapter, layer: nn.Module, config, x: torch.Tensor, kept: list[int],
               damp: float, sweeps: int = 3, offset: torch.Tensor | None = None) -> RefitResult:
    """Refit the down projections of experts ``kept`` of the unpruned ``layer`` (original indices)
    on MoE-block inputs ``x`` [T, H]; returns the new matrices and the residual before and after.
    ``offset`` [T, H] is added to the target (the unpruned block's routed output)."""
    x = x.reshape(-1, x.shape[-1])
    y = routed_output_full(adapter, layer, config, x)
    if offset is not None:
        y = y + offset
    logits = adapter.route(layer, x, config).logits.float()
    mask = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
    mask[kept] = True
    weights, index = pruned_routing(logits, mask, adapter.routing_rule(layer, config))
    pred = torch.zeros_like(y)
    systems: dict[int, _ExpertSystem] = {}
    down: dict[int, torch.Tensor] = {}
    for j in kept:
        original = adapter.expert_view(layer, j).down
        token, slot = (index == j).nonzero(as_tuple=True)
        bias = adapter.expert_down_bias(layer, j)
        if bias is not None and token.numel():  # gpt-oss: a fixed part of the prediction
            pred.index_add_(0, token, weights[token, slot][:, None].float() * bias.float())
        if token.numel() == 0:  # no calibration token reaches it: nothing to fit
            down[j] = original.clone()
            continue
        z = weights[token, slot][:, None] * adapter.expert_hidden(layer, j, x[token]).float()
        gram = (z.t() @ z).double()
        lam = damp * float(gram.diagonal().mean()) + 1e-12
        gram.diagonal().add_(lam)
        system = _ExpertSystem(token=token, z=z, chol=torch.linalg.cholesky(gram),
                               prior=lam * original.double().t(),
                               w_t=original.float().t().contiguous())
        pred.index_add_(0, token, z @ system.w_t)
        systems[j] = system
    error_before = float((y - pred).double().pow(2).sum())
    for _ in range(sweeps):
        for s in systems.values():
            pred.index_add_(0, s.token, -(s.z @ s.w_t))
            rhs = s.z.t().double() @ (y[s.token] - pred[s.token]).double() + s.prior
            s.w_t = torch.cholesky_solve(rhs, s.chol).float()
            pred.index_add_(0, s.token, s.z @ s.w_t)
    norm = max(float(y.double().pow(2).sum()), 1e-30)
    error_after = float((y - pred).double().pow(2).sum())
    dtype = adapter.expert_view(layer, kept[0]).down.dtype
    for j, s in systems.items():
        down[j] = s.w_t.t().to(dtype).contiguous()
    return RefitResult(down=down, error_before=error_before / norm,
                       error_after=error_after / norm, tokens=x.shape[0])


@dataclass
class _ExpertSystem:
    """One kept expert's share of the least-squares problem."""

    token: torch.Tensor  # [n] the tokens routed to it after pruning
    z: torch.Tensor  # [n, I] gate * h_j(x): what its down projection multiplies
    chol: torch.Tensor  # [I, I] Cholesky factor of z^T z + lambda I (fp64)
    prior: torch.Tensor  # [I, H] lambda * W_original^T (fp64): the ridge's pull
    w_t: torch.Tensor  # [I, H] the current W^T
