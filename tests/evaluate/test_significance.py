"""Paired differences: the bootstrap interval and the exact sign test."""

from __future__ import annotations

import random

import pytest

from thresher.evaluate.significance import paired_difference, sign_test


def test_sign_test_matches_the_binomial_tail():
    assert sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(5, 5) == 1.0
    assert sign_test(0, 0) == 1.0
    assert sign_test(2, 10) == sign_test(10, 2) == pytest.approx(2 * 79 / 4096)


def test_a_consistent_drop_is_beyond_noise_and_a_reshuffle_is_not():
    rng = random.Random(0)
    base = [float(rng.random() < 0.6) for _ in range(300)]
    worse = [b if rng.random() < 0.8 else 0.0 for b in base]  # loses ~12% of its right answers
    drop = paired_difference(base, worse)
    assert drop.delta < 0 and drop.high < 0 and drop.beyond_noise
    assert drop.low <= drop.delta <= drop.high and drop.n == 300
    assert drop.p_value < 1e-6
    assert drop.describe().endswith(" *")
    same = paired_difference(base, list(base))
    assert (same.delta, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert not same.beyond_noise and not same.describe().endswith("*")
    swapped = base[1:] + base[:1]  # same mean, unrelated per document
    noise = paired_difference(base, swapped)
    assert noise.low < 0 < noise.high and not noise.beyond_noise


def test_pairing_sees_what_separate_errors_hide():
    """Graded scores that differ by a small constant per document: the separate ± intervals
    overlap, the paired interval is far from zero."""
    rng = random.Random(1)
    base = [rng.random() for _ in range(200)]
    variant = [b - 0.02 for b in base]
    d = paired_difference(base, variant)
    assert d.beyond_noise and d.high < -0.019
    sd = (sum((b - sum(base) / 200) ** 2 for b in base) / 199) ** 0.5
    assert 2 * sd / 200 ** 0.5 > 0.02  # the unpaired standard errors would overlap


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="base has 3 documents, the variant 2"):
        paired_difference([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="no documents"):
        paired_difference([], [])
    with pytest.raises(ValueError, match="confidence=1.5"):
        paired_difference([1.0], [0.0], confidence=1.5)
