"""How many experts each MoE layer loses: the same number everywhere, or a global number split by
measured damage.

A ``damage`` budget removes as many experts in total as the uniform one (the stage's ratio or keep
applied to every layer) but lets layers whose experts are redundant lose more and layers that
suffer lose fewer. ``allocate`` splits the total exactly: a dynamic program over the layers that
minimizes the sum of the layers' local reconstruction errors (``reconstruction``; they are on one
scale, relative to the residual stream), each layer within its bounds.
"""

from __future__ import annotations

import math

from thresher.errors import CompressionError


def removal_bounds(num_experts: int, top_k: int, min_keep_fraction: float,
                   protected: int) -> int:
    """The most experts one layer may lose: it keeps at least ``ceil(min_keep_fraction * E)``,
    at least top-k, and its ``protected`` experts."""
    floor = max(math.ceil(min_keep_fraction * num_experts - 1e-9), top_k, protected)
    return max(num_experts - floor, 0)


def allocate(damage: dict[int, list[float]], total: int) -> dict[int, int]:
    """Removals per layer summing to ``total`` that minimize the summed damage; ``damage[layer][r]``
    is the layer's error with ``r`` experts removed, for r = 0 .. the layer's bound."""
    layers = sorted(damage)
    capacity = sum(len(damage[i]) - 1 for i in layers)
    if total > capacity:
        raise CompressionError(
            f"the budget removes {total} experts but the layers' bounds allow at most {capacity}; "
            "lower min_keep_fraction or prune less")
    inf = math.inf
    best = [0.0] + [inf] * total  # best[t]: least damage of the layers so far removing t experts
    choice: list[list[int]] = []
    for i in layers:
        nxt, pick = [inf] * (total + 1), [0] * (total + 1)
        for t in range(total + 1):
            for r in range(min(t, len(damage[i]) - 1) + 1):
                cost = best[t - r] + damage[i][r]
                if cost < nxt[t]:
                    nxt[t], pick[t] = cost, r
        best = nxt
        choice.append(pick)
    removed: dict[int, int] = {}
    t = total
    for i, pick in zip(reversed(layers), reversed(choice), strict=True):
        removed[i] = pick[t]
        t -= pick[t]
    return dict(sorted(removed.items()))
