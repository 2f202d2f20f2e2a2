"""Merging groups of experts into one: frequency-weighted averaging of their weights.

Both merging baselines of the REAP paper end here. A group's merged expert is
sum_j w_j W_j / sum_j w_j over its members j, for every expert matrix, with w_j the share of
routed calibration tokens expert j received (a group nobody was routed to is averaged
uniformly). With ``permute``, every member's intermediate neurons are first reordered to match
its leader's (weight matching: the assignment maximizing the summed inner products of the
neurons' gate rows, up rows and down columns, solved exactly by the Hungarian method), which
changes no member's function and lines up what averaging combines (M-SMoE).

The merged layer keeps one router row per group: the leader's (``router: leader``), or the
frequency-weighted average of the members' rows (``average``). The reference implementations
instead keep all E rows and let every member's slot point at the shared merged weights (their
checkpoints keep E experts); a checkpoint with fewer experts needs one row per group. A group of
one is copied as it is, so merging every expert with itself reproduces the model exactly.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment

from thresher.errors import CompressionError
from thresher.models.adapters import MEMORY_DOWN, MEMORY_EXPERTS_PREFIX, MEMORY_GATE_UP, Adapter
from thresher.prune.mask import router_prefix


def group_weights(members: list[int], frequency: torch.Tensor) -> torch.Tensor:
    """[len(members)] float64 averaging weights summing to 1: the members' frequencies."""
    w = frequency[members].double()
    total = w.sum()
    return w / total if total > 0 else torch.full_like(w, 1.0 / len(members))


def neuron_features(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """[I, 3H]: each intermediate neuron's gate row, up row and down column, side by side."""
    inter = down.shape[-1]
    return torch.cat([gate_up[:inter], gate_up[inter:], down.T], dim=1).double()


def align_to_leader(leader: tuple[torch.Tensor, torch.Tensor],
                    member: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``member``'s (gate_up [2I, H], down [H, I]) with its neurons reordered to match
    ``leader``'s; the member's output on any input is unchanged."""
    similarity = neuron_features(*leader) @ neuron_features(*member).T  # [I leader, I member]
    _, perm = linear_sum_assignment(similarity.numpy(), maximize=True)
    perm_t = torch.as_tensor(perm, dtype=torch.long)
    gate_up, down = member
    inter = down.shape[-1]
    return torch.cat([gate_up[:inter][perm_t], gate_up[inter:][perm_t]]), down[:, perm_t]


def merge_layer_state(adapter: Adapter, layer_idx: int, state: dict[str, torch.Tensor],
                      groups: list[list[int]], frequency: torch.Tensor, router: str,
                      permute: bool, num_experts: int) -> dict[str, torch.Tensor]:
    """One MoE layer's in-memory state (keys relative to the layer) with its experts replaced by
    one merged expert per group (each group's leader first), in the order of ``groups``; router
    rows as ``router`` says; every other tensor (attention, norms, shared expert) as it is."""
    router_key = router_prefix(adapter, layer_idx)
    expert_keys = [k for k in state if k.startswith(MEMORY_EXPERTS_PREFIX)]
    if not expert_keys or not any(k.startswith(router_key) for k in state):
        raise CompressionError(
            f"layer {layer_idx}: found no router ({router_key}*) or fused experts "
            f"({MEMORY_EXPERTS_PREFIX}*) in the checkpoint; is this an MoE layer?")
    if permute and set(expert_keys) != {MEMORY_GATE_UP, MEMORY_DOWN}:
        raise CompressionError(
            f"layer {layer_idx}: neuron alignment knows gate_up_proj and down_proj, the experts "
            f"also hold {sorted(set(expert_keys) - {MEMORY_GATE_UP, MEMORY_DOWN})}; merge with "
            "permute: false")
    # router tensors with the experts along their first axis (ERNIE's [1, E] bias moved)
    routers = {k: v.movedim(adapter.router_expert_dim(k), 0) for k, v in state.items()
               if k.startswith(router_key) and v.dim() > 0}
    for key in expert_keys + [k for k in state if k.startswith(router_key)]:
        tensor = routers.get(key, state[key])
        if tensor.dim() == 0 or tensor.shape[0] != num_experts:
            raise CompressionError(
                f"layer {layer_idx}: {key} has shape {tuple(state[key].shape)}, expected "
                f"{num_experts} experts along its dimension {adapter.router_expert_dim(key)}")
    experts = {k: [] for k in expert_keys}
    for members in groups:
        tensors = {k: [state[k][e] for e in members] for k in expert_keys}
        if permute:
            leader = (tensors[MEMORY_GATE_UP][0], tensors[MEMORY_DOWN][0])
            for i in range(1, len(members)):
                aligned = align_to_leader(leader, (tensors[MEMORY_GATE_UP][i],
                                                   tensors[MEMORY_DOWN][i]))
                tensors[MEMORY_GATE_UP][i], tensors[MEMORY_DOWN][i] = aligned
        weights = group_weights(members, frequency)
        for key, parts in tensors.items():
            experts[key].append(_average(parts, weights))
    out = {}
    for key, tensor in state.items():
        if key in experts:
            out[key] = torch.stack(experts[key]).contiguous()
        elif key.startswith(router_key):
            rows = routers[key]
            out[key] = torch.stack([
                rows[members[0]] if router == "leader" or len(members) == 1
                else _average([rows[e] for e in members], group_weights(members, frequency))
                for members in groups]).movedim(0, adapter.router_expert_dim(key)).contiguous()
        else:
            out[key] = tensor
    return out


def _average(parts: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """sum_j w_j parts_j in float64, back in the parts' dtype (a single part: itself)."""
    if len(parts) == 1:
        return parts[0].clone()
    total = sum(w * p.double() for w, p in zip(weights.tolist(), parts, strict=True))
    return total.to(parts[0].dtype)
