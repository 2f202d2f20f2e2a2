"""Choosing the experts to keep and cutting them out of a decoder layer's weights.

Pruning is per layer and uniform (as in REAP): every MoE layer keeps the same number of
experts, its highest-saliency ones. Applying the mask keeps the surviving experts' slices of the
fused expert tensors and the matching router rows (and router bias / score-correction bias where a
family has them), in their original order; shared experts and everything else are untouched, and
top-k stays as it was, so the number kept must be at least top-k.
"""

from __future__ import annotations

import math

import torch

from thresher.errors import CompressionError
from thresher.models.adapters import MEMORY_EXPERTS_PREFIX, Adapter


def experts_to_keep(num_experts: int, top_k: int, ratio: float | None, keep: int | None,
                    model: str) -> int:
    """How many experts each MoE layer keeps; refuses options that do not fit ``model``."""
    if (ratio is None) == (keep is None):
        raise CompressionError(f"{model}: give exactly one of ratio and keep for pruning")
    if ratio is not None:
        if not 0.0 < ratio < 1.0:
            raise CompressionError(f"{model}: prune ratio must be in (0, 1), got {ratio}")
        removed = math.floor(num_experts * ratio)
        if removed == 0:
            raise CompressionError(
                f"{model}: ratio {ratio} of {num_experts} experts removes none; "
                f"use a ratio of at least {1 / num_experts:.4g}")
        n_keep = num_experts - removed
    else:
        n_keep = keep
        if not 0 < n_keep < num_experts:
            raise CompressionError(
                f"{model}: keep={keep} must be between 1 and {num_experts - 1} "
                f"(the model has {num_experts} experts per layer)")
    if n_keep < top_k:
        raise CompressionError(
            f"{model}: pruning would leave {n_keep} experts per layer, fewer than the "
            f"{top_k} each token is routed to (top-k); prune less")
    return n_keep


def choose_experts(saliency: torch.Tensor, n_keep: int) -> list[int]:
    """Indices (ascending) of the ``n_keep`` highest-saliency experts; ties keep the lower index."""
    order = torch.argsort(-saliency, stable=True)
    return sorted(order[:n_keep].tolist())


def router_prefix(adapter: Adapter, layer_idx: int) -> str:
    """The router's key prefix inside a layer's in-memory state (``mlp.gate.``)."""
    layer_prefix = adapter.disk_layer_prefix(layer_idx)
    return adapter.memory_key_from_disk(adapter.disk_router_key(layer_idx))[len(layer_prefix):] + "."


def prune_layer_state(adapter: Adapter, layer_idx: int, state: dict[str, torch.Tensor],
                      kept: list[int], num_experts: int) -> dict[str, torch.Tensor]:
    """Keep experts ``kept`` in one MoE layer's in-memory state (keys relative to the layer):
    slices the fused expert tensors and the router's per-expert rows (weight, bias, correction
    bias), leaves every other tensor (attention, norms, shared expert) as it is."""
    index = torch.tensor(kept, dtype=torch.long)
    router = router_prefix(adapter, layer_idx)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.startswith((router, MEMORY_EXPERTS_PREFIX)):
            dim = adapter.router_expert_dim(key) if key.startswith(router) else 0
            if tensor.dim() == 0 or tensor.shape[dim] != num_experts:
                raise CompressionError(
                    f"layer {layer_idx}: {key} has shape {tuple(tensor.shape)}, expected "
                    f"{num_experts} experts along its dimension {dim}")
            out[key] = tensor.index_select(dim, index).contiguous()
        else:
            out[key] = tensor
    if not (any(k.startswith(router) for k in state)
            and any(k.startswith(MEMORY_EXPERTS_PREFIX) for k in state)):
        raise CompressionError(
            f"layer {layer_idx}: found no router ({router}*) or fused experts "
            f"({MEMORY_EXPERTS_PREFIX}*) in the checkpoint; is this an MoE layer?")
    return out
