"""HC-SMoE's grouping ("Retraining-free merging of sparse MoE via hierarchical clustering",
Chen et al., 2024), as the REAP paper runs it.

Every expert is described by its mean output over all calibration tokens (every expert run on
every token, so the description does not depend on the router); agglomerative clustering with
Euclidean distances and average linkage (the REAP reference's ``characteristic_activation``,
``euclidean``, ``average``) merges the two closest clusters until ``n`` are left. Each cluster is
then merged by frequency-weighted averaging; its most used member is its leader (whose router row
the merged expert keeps with ``router: leader``).
"""

from __future__ import annotations

import torch


def agglomerate(points: torch.Tensor, n: int, linkage: str = "average") -> list[list[int]]:
    """Cluster the rows of ``points`` [E, D] into ``n`` clusters (lists of ascending indices,
    ordered by their smallest member). Distances between clusters follow ``linkage``:
    'average' (mean pairwise distance), 'single' (closest pair) or 'complete' (farthest pair),
    kept up to date with the Lance-Williams updates; ties merge the first pair in index order."""
    points = points.double()
    dist = torch.cdist(points, points)
    clusters: list[list[int] | None] = [[i] for i in range(points.shape[0])]
    dist.fill_diagonal_(float("inf"))
    alive = points.shape[0]
    while alive > n:
        a, b = divmod(int(torch.argmin(dist)), dist.shape[1])
        a, b = min(a, b), max(a, b)
        size_a, size_b = len(clusters[a]), len(clusters[b])
        if linkage == "average":
            merged = (size_a * dist[a] + size_b * dist[b]) / (size_a + size_b)
        elif linkage == "single":
            merged = torch.minimum(dist[a], dist[b])
        elif linkage == "complete":
            merged = torch.maximum(dist[a], dist[b])
        else:
            raise ValueError(f"unknown linkage {linkage!r}")
        dist[a], dist[:, a] = merged, merged
        dist[a, a] = float("inf")
        dist[b], dist[:, b] = float("inf"), float("inf")
        clusters[a] = sorted(clusters[a] + clusters[b])
        clusters[b] = None
        alive -= 1
    return sorted((c for c in clusters if c is not None), key=lambda c: c[0])


def lead_by_frequency(clusters: list[list[int]], frequency: torch.Tensor) -> list[list[int]]:
    """Each cluster with its most used member first (ties: the lower index), the rest ascending."""
    out = []
    for members in clusters:
        leader = max(members, key=lambda e: (float(frequency[e]), -e))
        out.append([leader] + [e for e in members if e != leader])
    return out
