"""Which experts each MoE layer keeps: one criterion or ``auto``, a uniform or damage budget, and
protected super experts.

With one criterion and a uniform budget every layer keeps its highest-saliency experts (REAP's
rule). ``auto`` considers, per layer, the expert sets of every criterion and of a greedy search on
the local reconstruction error, and keeps the one whose removal changes the MoE block's output
least on held-out calibration tokens. A ``damage`` budget measures each layer's error for every
number of removed experts within its bounds and splits the uniform total across the layers
(``budget.allocate``). Protected experts are never removed by any candidate.

The stage's ``damage`` says what "error" is: ``local``, the block's reconstruction error
(``reconstruction``), or ``loss``, the increase of the model's held-out next-token loss when only
that layer is pruned (``endtoend``), which sees what later layers make of the change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from thresher.errors import CompressionError
from thresher.prune.budget import allocate, removal_bounds
from thresher.prune.endtoend import Losses, Plan, single_layer_damage
from thresher.prune.mask import choose_experts
from thresher.prune.observer import ExpertStats, Observation
from thresher.prune.reconstruction import greedy_removal_order, removal_error, routed_output
from thresher.prune.saliency import OBSERVED_METHODS, saliency, super_experts
from thresher.recipe import PruneStage

GREEDY = "greedy"
AUTO_CANDIDATES = (*OBSERVED_METHODS, GREEDY)



@dataclass
class LayerChoice:
    """What one MoE layer keeps and why."""

    kept: list[int]
    criterion: str  # the method whose expert set was kept (auto: the winner)
    protected: list[int] = field(default_factory=list)
    local_error: float | None = None  # held-out local error of the kept set (None: not measured)
    errors: dict[str, float] = field(default_factory=dict)  # every candidate's, same count
    loss_increase: float | None = None  # damage 'loss': held-out loss increase of the kept set
    damage: list[float] = field(default_factory=list)  # damage budget: the DP's input, r = 0..


def needs_probes(stage: PruneStage) -> bool:
    """Whether the stage measures local errors (and so holds calibration windows out)."""
    return stage.method == "auto" or stage.budget == "damage"


def plan_layers(stage: PruneStage, observed: list[ExpertStats] | Observation, num_layers: int,
                num_experts: int, top_k: int, n_keep: int, model: str,
                end_to_end: Losses | None = None) -> dict[int, LayerChoice]:
    """The kept experts of every observed MoE layer under ``stage`` (``n_keep``: the uniform
    number kept per layer, which a damage budget keeps on average). ``end_to_end`` gives the held-out
    loss of pruning plans for ``damage: loss`` (``endtoend.loss_of`` on the model and the
    held-out windows)."""
    stats = observed.stats if isinstance(observed, Observation) else observed
    protected = super_experts(stats, num_layers) if stage.protect_super_experts else {}
    for layer, experts in protected.items():
        if len(experts) > n_keep and stage.budget == "uniform":
            raise CompressionError(
                f"{model}: layer {layer} has {len(experts)} super experts, more than the "
                f"{n_keep} experts it keeps; prune less or turn protect_super_experts off")
    if not needs_probes(stage):
        return {s.layer: LayerChoice(
            kept=choose_experts(_protect(saliency(stage.method, s), protected.get(s.layer, [])),
                                n_keep),
            criterion=stage.method, protected=protected.get(s.layer, [])) for s in stats}
    if not isinstance(observed, Observation) or not observed.heldout:
        raise CompressionError(
            f"{model}: prune method {stage.method!r} with budget {stage.budget!r} measures local "
            "errors on held-out windows; observe with observe_layers(..., heldout=...)")
    names = AUTO_CANDIDATES if stage.method == "auto" else (stage.method,)
    uniform = num_experts - n_keep
    tables: dict[int, dict[str, list[tuple[float, list[int]]]]] = {}
    for s in stats:
        prot = protected.get(s.layer, [])
        bound = (removal_bounds(num_experts, top_k, stage.min_keep_fraction, len(prot))
                 if stage.budget == "damage" else uniform)
        tables[s.layer] = _error_table(s, observed, names, prot, bound)
    measured = tables
    if stage.damage == "loss":
        if end_to_end is None:
            raise CompressionError(
                f"{model}: damage 'loss' runs the model on held-out windows; pass end_to_end")
        measured = _loss_tables(tables, end_to_end, num_experts)
    damage = {i: [min(t[name][r][0] for name in names) for r in range(len(t[names[0]]))]
              for i, t in measured.items()}
    total = uniform * len(stats) if stage.budget == "damage" else None
    marginal: dict[int, dict[str, float]] = {}
    if stage.sequential and end_to_end is not None:
        removed, marginal = _sequential(measured, damage, names, end_to_end, uniform, total)
    elif total is not None:
        removed = allocate(damage, total)
    else:
        removed = {i: uniform for i in tables}
    plan: dict[int, LayerChoice] = {}
    for i, table in measured.items():
        r = removed[i]
        errors = marginal.get(i) or {name: table[name][r][0] for name in names}
        best = min(names, key=errors.__getitem__)  # ties: the earlier candidate
        kept = table[best][r][1]
        plan[i] = LayerChoice(
            kept=kept, criterion=best, protected=protected.get(i, []),
            local_error=next(e for e, k in tables[i][best] if k == kept), errors=errors,
            loss_increase=errors[best] if stage.damage == "loss" else None,
            damage=damage[i] if stage.budget == "damage" else [])
    return plan


def _loss_tables(tables: dict[int, dict[str, list[tuple[float, list[int]]]]], end_to_end: Losses,
                 num_experts: int) -> dict[int, dict[str, list[tuple[float, list[int]]]]]:
    """``tables`` with each kept set's local error replaced by its end-to-end loss increase
    (the full set's is 0: nothing removed)."""
    sets = {i: [tuple(k) for rows in t.values() for _, k in rows if len(k) < num_experts]
            for i, t in tables.items()}
    loss = single_layer_damage(end_to_end, sets)
    return {i: {name: [(loss[i][tuple(k)] if len(k) < num_experts else 0.0, k) for _, k in rows]
                for name, rows in t.items()} for i, t in tables.items()}


def _protect(scores: torch.Tensor, protected: list[int]) -> torch.Tensor:
    scores = scores.clone()
    scores[protected] = float("inf")
    return scores


def _error_table(stats: ExpertStats, observed: Observation, names: tuple[str, ...],
                 protected: list[int], bound: int) -> dict[str, list[tuple[float, list[int]]]]:
    """For every candidate and every removal count 0..bound: (held-out local error, kept)."""
    num_experts = stats.num_experts
    if bound > num_experts - len(protected):
        raise CompressionError(
            f"layer {stats.layer}: {len(protected)} protected experts leave only "
            f"{num_experts - len(protected)} to remove, the budget asks for {bound}")
    heldout = observed.heldout[stats.layer]
    full = routed_output(heldout, torch.ones(num_experts, dtype=torch.bool))
    table: dict[str, list[tuple[float, list[int]]]] = {}
    for name in names:
        if name == GREEDY:
            order = greedy_removal_order(observed.search[stats.layer], protected, bound)
            sets = [sorted(set(range(num_experts)) - set(order[:r])) for r in range(bound + 1)]
        else:
            scores = _protect(saliency(name, stats), protected)
            sets = [choose_experts(scores, num_experts - r) for r in range(bound + 1)]
        table[name] = [(removal_error(heldout, kept, full), kept) for kept in sets]
    return table


def _sequential(measured: dict[int, dict[str, list[tuple[float, list[int]]]]],
                damage: dict[int, list[float]], names: tuple[str, ...], losses: Losses,
                uniform: int, total: int | None) -> tuple[dict[int, int], dict[int, dict[str, float]]]:
    """Layer by layer in order, the removal count and candidate whose loss, measured with the
    earlier layers already pruned as chosen, plus the least single-layer damage the later layers
    can take the rest of the budget with (``total``; None: ``uniform`` everywhere), is least.
    Returns the removals and, per layer, each candidate's loss increase over the earlier layers'
    at the chosen count."""
    layers = sorted(measured)
    prefix: Plan = {}
    removed: dict[int, int] = {}
    marginal: dict[int, dict[str, float]] = {}
    before = losses([{}])[0]
    left = total
    for n, i in enumerate(layers):
        rest = {j: damage[j] for j in layers[n + 1:]}
        options: dict[tuple[int, tuple[int, ...]], float] = {}  # (r, kept) -> damage to go
        for r in (range(len(damage[i])) if left is not None else (uniform,)):
            to_go = 0.0 if left is None else _least_damage(rest, left - r)
            if to_go is None:
                continue
            for name in names:
                options.setdefault((r, tuple(measured[i][name][r][1])), to_go)
        keys = list(options)
        joint = dict(zip(keys, losses([{**prefix, i: kept} for _, kept in keys]), strict=True))
        r, kept = min(keys, key=lambda k: joint[k] + options[k])  # ties: the first listed
        marginal[i] = {name: joint[(r, tuple(measured[i][name][r][1]))] - before
                       for name in names}
        before = joint[(r, kept)]
        prefix[i], removed[i] = kept, r
        left = None if left is None else left - r
    return removed, marginal


def _least_damage(damage: dict[int, list[float]], total: int) -> float | None:
    """The least summed damage with which ``damage``'s layers remove ``total`` (None: cannot)."""
    if total < 0 or total > sum(len(d) - 1 for d in damage.values()):
        return None
    if not damage:
        return 0.0
    return sum(damage[i][r] for i, r in allocate(damage, total).items())
