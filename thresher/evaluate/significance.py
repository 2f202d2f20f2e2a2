"""Is a variant's task score different from the base's, or is it noise?

Every variant answers the same documents as the base, so the question is about paired
differences: per document, variant score minus base score. Pairing removes the spread between
easy and hard documents, which dominates an unpaired standard error: two variants that agree on
most documents can differ beyond noise while their separate ± intervals overlap.

``paired_difference`` gives the mean difference with a percentile bootstrap interval (resampling
documents, so it works for 0/1 scores and for graded ones such as character similarity alike),
and the exact two-sided sign test on the documents where the two differ (for 0/1 scores this is
McNemar's exact test). A difference is beyond noise when the interval excludes zero.
``paired_documents`` lines two runs' scores up by document identity (a hash of each document's
prompt and target), never by position, and refuses two runs scored on different documents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from thresher.errors import EvaluationError

BOOTSTRAP_ITERS = 2000
CONFIDENCE = 0.95
# Perplexity intervals resample blocks of this many neighbouring windows (8 of the default 64
# evaluation windows of 256 tokens: 2k tokens, about one source file of the stdlib corpus) ...
PERPLEXITY_BLOCK = 8
MIN_BLOCKS = 4  # ... but never fewer than this many blocks


@dataclass(frozen=True)
class PairedDifference:
    """Mean of (variant - base) over the paired documents, its interval and sign-test p-value."""

    delta: float
    low: float
    high: float
    n: int
    p_value: float
    confidence: float = CONFIDENCE

    @property
    def beyond_noise(self) -> bool:
        """The interval excludes zero."""
        return self.low > 0 or self.high < 0

    def describe(self, digits: int = 3) -> str:
        """``-0.042 [-0.071, -0.013] *``: the star marks a difference beyond noise."""
        text = f"{self.delta:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"
        return text + (" *" if self.beyond_noise else "")


def paired_difference(base: Sequence[float], variant: Sequence[float],
                      iters: int = BOOTSTRAP_ITERS, confidence: float = CONFIDENCE,
                      seed: int = 0) -> PairedDifference:
    """Paired bootstrap interval and sign test of ``variant - base``, document by document."""
    if len(base) != len(variant):
        raise ValueError(f"paired scores: base has {len(base)} documents, the variant "
                         f"{len(variant)}; both must be scored on the same documents")
    if not base:
        raise ValueError("paired scores: no documents")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: must be in (0, 1)")
    diff = np.asarray(variant, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(iters, len(diff)))].mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return PairedDifference(float(diff.mean()), float(low), float(high), len(diff),
                            sign_test(int((diff > 0).sum()), int((diff < 0).sum())), confidence)


def paired_documents(base: Mapping[str, float], variant: Mapping[str, float], what: str = "scores"
                     ) -> tuple[list[float], list[float]]:
    """The two runs' scores on the same documents, in the base's order, matched by document key
    (``tasks.document_key``). Raises EvaluationError, naming ``what`` and a few of the documents
    only one side has, when the two were not scored on the same documents."""
    only_base = [k for k in base if k not in variant]
    only_variant = [k for k in variant if k not in base]
    if only_base or only_variant:
        raise EvaluationError(
            f"{what}: the base and the variant were scored on different documents "
            f"({len(only_base)} only in the base, e.g. {only_base[:2]}; {len(only_variant)} only "
            f"in the variant, e.g. {only_variant[:2]}); score both on the same task data and "
            "limit to compare them")
    keys = list(base)
    return [float(base[k]) for k in keys], [float(variant[k]) for k in keys]


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided binomial p-value of ``wins`` against ``losses`` under p = 1/2 (ties are
    left out); 1.0 when there are none."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class PairedPerplexity:
    """Two models on the same held-out windows: the per-window mean-NLL difference (variant -
    base, nats per token), its paired interval, and how many windows the variant scores better.

    Every window scores the same number of tokens, so the mean of the per-window differences is
    the difference of the two overall NLLs and ``exp`` of it the perplexity ratio."""

    nll: PairedDifference  # its n counts the resampled blocks
    better: int  # windows where the variant's NLL is lower
    windows: int  # windows compared

    @property
    def ratio(self) -> tuple[float, float, float]:
        """Perplexity ratio variant / base - 1, with its interval (fractions, not percent)."""
        return (math.expm1(self.nll.delta), math.expm1(self.nll.low), math.expm1(self.nll.high))

    def describe(self) -> str:
        """``-0.12% [-0.20%, -0.04%] *, 51/64 better``: perplexity change with its interval."""
        d, lo, hi = (100 * r for r in self.ratio)
        star = " *" if self.nll.beyond_noise else ""
        return f"{d:+.3f}% [{lo:+.3f}%, {hi:+.3f}%]{star}, {self.better}/{self.windows} better"


def paired_perplexity(base_nll: Sequence[float], variant_nll: Sequence[float],
                      iters: int = BOOTSTRAP_ITERS, confidence: float = CONFIDENCE,
                      seed: int = 0, block: int | None = None) -> PairedPerplexity:
    """Paired bootstrap over windows of ``variant - base`` per-window mean NLL (from
    ``evaluate.perplexity.window_nlls`` on the same windows).

    Held-out windows are consecutive cuts of one text, so neighbours (the same source file) are
    alike, and resampling single windows as if independent makes the interval too narrow. The
    bootstrap therefore resamples runs of ``block`` consecutive windows (a non-overlapping block
    bootstrap; a remainder is dropped); by default ``default_block(len(windows))``, blocks of
    ``PERPLEXITY_BLOCK``. ``block=1`` is the per-window interval. ``better`` always counts single
    windows."""
    base = np.asarray(base_nll, dtype=np.float64)
    variant = np.asarray(variant_nll, dtype=np.float64)
    block = default_block(len(base)) if block is None else block
    if len(base) != len(variant) or block < 1:
        raise ValueError(f"paired windows: {len(base)} and {len(variant)} windows, block "
                         f"{block}; both must be scored on the same windows, block >= 1")
    n = len(base) // block * block
    if n == 0:
        raise ValueError(f"paired windows: {len(base)} windows, fewer than one block of {block}")
    diff = paired_difference(base[:n].reshape(-1, block).mean(axis=1).tolist(),
                             variant[:n].reshape(-1, block).mean(axis=1).tolist(),
                             iters, confidence, seed)
    return PairedPerplexity(diff, int((variant < base).sum()), len(base))


def default_block(windows: int) -> int:
    """Windows per resampled block: ``PERPLEXITY_BLOCK``, fewer where that would leave under
    ``MIN_BLOCKS`` blocks to resample (1 for fewer than 2 * MIN_BLOCKS windows)."""
    return max(1, min(PERPLEXITY_BLOCK, windows // MIN_BLOCKS))
