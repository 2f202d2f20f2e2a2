"""Local reconstruction error: how much removing experts changes one MoE block's output.

A pruned layer routes each token among the experts it kept, by its family's rule
(``RoutingRule``: softmax or sigmoid scores of the kept experts, top-k, renormalized and scaled as
the family's forward does). On a set of probed
tokens (``LayerProbe``: router logits and every expert's output on every token, recorded while the
observer walks the layers) that output can be recomputed for any kept set without running the
model again. The error of a kept set is the summed squared change of the routed output divided by
the summed squared norm of the layer's output hidden state (the residual stream after the layer),
so that errors of different layers are on one scale and can be added (``budget``).

``auto`` measures its candidate sets on probes of held-out calibration windows; the ``greedy``
candidate searches on probes of the saliency windows: it removes, one at a time, the expert whose
removal changes the block's output least.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from thresher.models.adapters import Adapter, RoutingRule


@dataclass
class LayerProbe:
    """One MoE layer on a sample of tokens: enough to recompute its routed output for any kept set."""

    layer: int
    logits: torch.Tensor  # [T, E] fp32 raw router logits
    outputs: torch.Tensor  # [E, T, H] fp32: every expert's output f_e(x) before gating
    residual_sq: float  # sum over the tokens of ||layer output||^2
    rule: RoutingRule  # how the router turns logits into gate values

    @property
    def top_k(self) -> int:
        return self.rule.top_k

    @property
    def tokens(self) -> int:
        return self.logits.shape[0]

    @property
    def num_experts(self) -> int:
        return self.logits.shape[1]


class ProbeRecorder:
    """Builds a ``LayerProbe`` from batches of the MoE block's input, up to ``max_tokens``."""

    def __init__(self, adapter: Adapter, layer: nn.Module, config, layer_idx: int,
                 max_tokens: int):
        self.adapter, self.layer, self.config = adapter, layer, config
        self.layer_idx, self.max_tokens = layer_idx, max_tokens
        self.rule = adapter.routing_rule(layer, config)  # the layer is released before probe()
        self.logits: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.residual_sq = 0.0
        self.taken = 0

    @torch.no_grad()
    def add_batch(self, hidden: torch.Tensor) -> int:
        """Record the first tokens of ``hidden`` [T, H] that still fit; returns how many."""
        n = min(hidden.shape[0], self.max_tokens - self.taken)
        if n <= 0:
            return 0
        x = hidden[:n]
        self.logits.append(self.adapter.route(self.layer, x, self.config).logits.float().cpu())
        self.outputs.append(torch.stack([
            self.adapter.expert_forward(self.layer, e, x).float()
            for e in range(self.adapter.num_experts(self.config))]).cpu())  # to the host
        self.taken += n
        return n

    def add_layer_output(self, out: torch.Tensor) -> None:
        """The decoder layer's output for the tokens ``add_batch`` took (same order)."""
        self.residual_sq += float(out.double().pow(2).sum())

    def probe(self) -> LayerProbe:
        return LayerProbe(
            layer=self.layer_idx, logits=torch.cat(self.logits), outputs=torch.cat(self.outputs, 1),
            residual_sq=self.residual_sq,
            rule=self.rule)


def pruned_routing(logits: torch.Tensor, kept: torch.Tensor, rule: RoutingRule
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate values and expert indices [T, k] of the pruned block (only experts ``kept`` [E], bool,
    remain), as the pruned checkpoint computes them from the raw router ``logits`` [T, E]."""
    return rule.select(logits, kept)


def routed_output(probe: LayerProbe, kept: torch.Tensor) -> torch.Tensor:
    """The routed part of the block's output [T, H] when only experts ``kept`` [E] (bool) remain."""
    weights, index = pruned_routing(probe.logits, kept, probe.rule)
    return _combine(probe, weights, index, torch.arange(probe.tokens))


def _combine(probe: LayerProbe, weights: torch.Tensor, index: torch.Tensor,
             tokens: torch.Tensor) -> torch.Tensor:
    """Gated sum [len(tokens), H] of the chosen experts' outputs on ``tokens``, given their gate
    values and expert indices [len(tokens), k]."""
    out = torch.zeros(len(tokens), probe.outputs.shape[-1])
    for slot in range(probe.top_k):
        out += weights[:, slot, None] * probe.outputs[index[:, slot], tokens]
    return out


def kept_mask(num_experts: int, kept: list[int]) -> torch.Tensor:
    mask = torch.zeros(num_experts, dtype=torch.bool)
    mask[kept] = True
    return mask


def removal_error(probe: LayerProbe, kept: list[int],
                  full: torch.Tensor | None = None) -> float:
    """Local reconstruction error of keeping ``kept``: sum ||y - y_kept||^2 / sum ||h_out||^2."""
    if full is None:
        full = routed_output(probe, torch.ones(probe.num_experts, dtype=torch.bool))
    diff = full - routed_output(probe, kept_mask(probe.num_experts, kept))
    return float(diff.double().pow(2).sum()) / max(probe.residual_sq, 1e-30)


def greedy_removal_order(probe: LayerProbe, protected: list[int], max_remove: int) -> list[int]:
    """Experts in the order a greedy search removes them: each step removes the expert whose
    removal (with the earlier ones) gives the smallest local error on ``probe``.

    A step scores every candidate, so a plain search recomputes the routed output of every token
    E times per step (E^2 times in all: minutes per layer at 64-128 experts). Removing one expert
    changes the output only on the tokens whose gates or experts it changes (with a renormalized
    top-k, those that routed to it), so each candidate's error is the current one corrected on
    those tokens alone; the routing itself is redone for all tokens, since a rule may couple
    them to the removed expert (a softmax over all experts, a group limit). Gates that moved by
    less than 1e-6 of their value (rounding: a renormalized softmax without e) count as unmoved."""
    full = routed_output(probe, torch.ones(probe.num_experts, dtype=torch.bool))
    everyone = torch.arange(probe.tokens)
    mask = torch.ones(probe.num_experts, dtype=torch.bool)
    order: list[int] = []
    for _ in range(max_remove):
        weights, index = pruned_routing(probe.logits, mask, probe.rule)
        per_token = (full - _combine(probe, weights, index, everyone)).double().pow(2).sum(-1)
        total = float(per_token.sum())
        best, best_error = -1, float("inf")
        for e in (int(e) for e in mask.nonzero().flatten() if int(e) not in protected):
            mask[e] = False
            w, i = pruned_routing(probe.logits, mask, probe.rule)
            mask[e] = True
            # a renormalized gate recomputed without e differs in its last bits only
            moved = (i != index) | ((w - weights).abs() > 1e-6 * weights.abs())
            changed = moved.any(-1).nonzero().flatten()
            new = _combine(probe, w[changed], i[changed], changed)
            error = total - float(per_token[changed].sum()) + float(
                (full[changed] - new).double().pow(2).sum())
            if error < best_error:
                best, best_error = e, error
        order.append(best)
        mask[best] = False
    return order
