"""Damage budgets: the split of a global number of removed experts across layers."""

import itertools
import random

import pytest

from thresher.errors import CompressionError
from thresher.prune.budget import allocate, removal_bounds


def test_bounds_keep_the_floor_top_k_and_the_protected_experts():
    assert removal_bounds(8, 2, 0.25, 0) == 6
    assert removal_bounds(8, 2, 0.5, 0) == 4
    assert removal_bounds(8, 4, 0.25, 0) == 4  # top-k wins over the fraction
    assert removal_bounds(8, 2, 0.25, 3) == 5  # 3 protected experts stay
    assert removal_bounds(8, 2, 1.0, 0) == 0


def test_allocation_sums_to_the_total_and_is_the_least_damage_of_every_split():
    rng = random.Random(0)
    for _ in range(20):
        damage = {layer: sorted(rng.random() for _ in range(rng.randint(2, 6)))
                  for layer in (0, 2, 5)}
        for layer in damage:
            damage[layer][0] = 0.0
        capacity = sum(len(d) - 1 for d in damage.values())
        total = rng.randint(0, capacity)
        removed = allocate(damage, total)
        assert sum(removed.values()) == total and sorted(removed) == [0, 2, 5]
        assert all(0 <= removed[i] < len(damage[i]) for i in damage)
        best = min(sum(damage[i][r] for i, r in zip(damage, split, strict=True))
                   for split in itertools.product(*(range(len(d)) for d in damage.values()))
                   if sum(split) == total)
        assert sum(damage[i][r] for i, r in removed.items()) == pytest.approx(best)


def test_redundant_layers_lose_more():
    damage = {0: [0.0, 0.01, 0.02, 0.03], 1: [0.0, 1.0, 2.0, 3.0]}
    assert allocate(damage, 3) == {0: 3, 1: 0}


def test_a_total_beyond_the_bounds_is_refused():
    with pytest.raises(CompressionError, match="at most 4"):
        allocate({0: [0.0, 1.0, 2.0], 1: [0.0, 1.0, 2.0]}, 5)
