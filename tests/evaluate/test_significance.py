"""Paired differences: the bootstrap interval and the exact sign test."""

from __future__ import annotations

import random

import pytest

from thresher.errors import EvaluationError
from thresher.evaluate.significance import paired_difference, paired_documents, sign_test
from thresher.evaluate.tasks import document_key


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


def test_documents_pair_by_identity_not_position():
    """Scores keyed by document: the variant's reordered scores pair with the same documents
    (a variant equal to the base is no difference at all, however its run ordered them), where
    pairing by position would see a spurious difference; a differing document is refused."""
    rng = random.Random(2)
    base = {f"doc{i}": float(rng.random() < 0.5) for i in range(200)}
    reordered = dict(reversed(list(base.items())))
    ours, theirs = paired_documents(base, reordered)
    assert ours == theirs == list(base.values())
    same = paired_difference(ours, theirs)
    assert (same.delta, same.low, same.high) == (0.0, 0.0, 0.0)
    by_position = paired_difference(list(base.values()), list(reordered.values()))
    assert by_position.low < by_position.high  # positions pair unrelated documents
    other = dict(base)
    other["doc7-edited"] = other.pop("doc7")
    with pytest.raises(EvaluationError, match=r"t/acc: .*different documents \(1 only in the "
                                              r"base, e\.g\. \['doc7'\]; 1 only in the variant"):
        paired_documents(base, other, "t/acc")
    with pytest.raises(EvaluationError, match="different documents"):
        paired_documents(base, dict(list(base.items())[:150]))


def test_document_key_is_the_prompt_and_target():
    """Two logged samples with the same prompt and target share a key whatever their doc ids;
    another target is another document."""
    row = {"doc_id": 3, "prompt_hash": "p1", "target_hash": "t1"}
    assert document_key(row) == document_key({**row, "doc_id": 9})
    assert document_key(row) != document_key({**row, "target_hash": "t2"})
