"""End-to-end damage: how much pruning some layers raises the model's next-token loss.

The local reconstruction error (``reconstruction``) sees one MoE block's output; it does not see
how much later layers amplify or absorb the change. ``heldout_losses`` runs the whole model on
held-out calibration windows once per pruning plan (a kept set for some MoE layers, the other
layers unpruned) and returns each plan's mean next-token cross-entropy. It walks the decoder
layers one at a time, as the observer does, and plans that agree on every layer so far share one
hidden state: the single-layer plans of a damage budget (every layer, every removal count, every
candidate) cost one forward of the unpruned model plus, per plan, the layers after its pruned one.

A pruned layer is computed as the pruned checkpoint computes it: a copy of the layer with the
kept experts' slices of the fused expert tensors and router rows (``mask.prune_layer_state``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from thresher.models.layerwise import LayerwiseModel
from thresher.prune.mask import prune_layer_state

Plan = dict[int, tuple[int, ...]]  # MoE layer -> experts kept (layers absent: unpruned)


def pruned_copy(lw: LayerwiseModel, i: int, kept: tuple[int, ...]) -> nn.Module:
    """A copy of resident decoder layer ``i`` that keeps only experts ``kept``."""
    layer, adapter = lw.layer(i), lw.adapter
    num_experts = adapter.num_experts(lw.config)
    state = prune_layer_state(adapter, i, layer.state_dict(), list(kept), num_experts)
    pruned = copy.deepcopy(layer)
    adapter.resize_experts(pruned, len(kept))
    pruned.load_state_dict(state, strict=True, assign=True)
    return pruned


@torch.no_grad()
def heldout_losses(lw: LayerwiseModel, windows: torch.Tensor, plans: Sequence[Plan],
                   batch_size: int = 8, show_progress: bool = True) -> list[float]:
    """Mean next-token cross-entropy of ``windows`` [N, S] under each plan (nats per token)."""
    lw.load_outer()
    batches = list(windows.split(batch_size))
    embedded = [lw.embed(b) for b in batches]
    pos = [lw.position_embeddings(h) for h in embedded]
    # states: the key of a plan up to the current layer (its pruned layers so far) -> hidden states
    states: dict[tuple, list[torch.Tensor]] = {(): embedded}
    keys: list[tuple] = [() for _ in plans]
    for i in tqdm(range(lw.num_layers), desc="end-to-end damage", unit="layer",
                  disable=not show_progress, leave=False):
        lw.load_layer(i)
        try:
            after: dict[tuple, list[torch.Tensor]] = {}
            for n, plan in enumerate(plans):
                key = keys[n] + (((i, plan[i]),) if i in plan else ())
                if key not in after:
                    module = pruned_copy(lw, i, plan[i]) if i in plan else lw.layer(i)
                    after[key] = [_layer_out(module(h, attention_mask=None, position_embeddings=p))
                                  for h, p in zip(states[keys[n]], pos, strict=True)]
                keys[n] = key
            states = after
        finally:
            lw.release_layer(i)
    losses: dict[tuple, float] = {}
    for key, hidden in states.items():
        total, count = 0.0, 0
        for h, b in zip(hidden, batches, strict=True):
            logits = lw.logits(h)[:, :-1].float()
            target = b[:, 1:].to(logits.device)
            total += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
            count += target.numel()
        losses[key] = total / count
    return [losses[k] for k in keys]


Losses = Callable[[Sequence[Plan]], list[float]]  # plans -> held-out loss of each


def loss_of(lw: LayerwiseModel, windows: torch.Tensor, batch_size: int = 8,
            show_progress: bool = True) -> Losses:
    """``heldout_losses`` on ``lw`` and ``windows``, as one callable for the planner."""
    def losses(plans: Sequence[Plan]) -> list[float]:
        return heldout_losses(lw, windows, plans, batch_size, show_progress)
    return losses


def single_layer_damage(losses: Losses, sets: dict[int, list[tuple[int, ...]]]
                        ) -> dict[int, dict[tuple[int, ...], float]]:
    """For every MoE layer and kept set in ``sets``: the increase of the held-out loss when only
    that layer is pruned to that set (the unpruned model's loss subtracted)."""
    plans: list[Plan] = [{}]
    index: list[tuple[int, tuple[int, ...]]] = []
    for layer, kept_sets in sets.items():
        for kept in dict.fromkeys(kept_sets):
            plans.append({layer: kept})
            index.append((layer, kept))
    measured = losses(plans)
    damage: dict[int, dict[tuple[int, ...], float]] = {layer: {} for layer in sets}
    for (layer, kept), loss in zip(index, measured[1:], strict=True):
        damage[layer][kept] = loss - measured[0]
    return damage


def _layer_out(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out
