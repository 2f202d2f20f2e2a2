"""Expert saliency: how much each expert matters to its layer, by REAP and by the baselines.

REAP (arXiv 2510.13999, Eq. 9): S_j = (1 / |X_j|) * sum_{x in X_j} g_j(x) * ||f_j(x)||_2,
the mean over the tokens X_j routed to expert j of the gate value times the expert output norm.
Baselines from the same paper: frequency (|X_j|, the routed-token count) and EAN
(sum_{x in X_j} ||f_j(x)||_2, expert activation norm); weighted EAN is the reference code's
``weighted_ean_sum``, sum_{x in X_j} g_j(x) * ||f_j(x)||_2 (REAP's numerator: it counts how often
an expert is used as well as how much). ``random`` is a seeded control.
Experts that received no calibration token score 0 under every observed method.
"""

from __future__ import annotations

import torch

from thresher.prune.observer import ExpertStats


def reap(stats: ExpertStats) -> torch.Tensor:
    """Mean gate-weighted output norm over the tokens routed to each expert."""
    count = stats.count.double()
    return torch.where(count > 0, stats.gated_norm_sum / count.clamp(min=1), 0.0)


def frequency(stats: ExpertStats) -> torch.Tensor:
    """Number of calibration tokens routed to each expert."""
    return stats.count.double()


def ean(stats: ExpertStats) -> torch.Tensor:
    """Summed output norm over the tokens routed to each expert."""
    return stats.norm_sum.clone()


def weighted_ean(stats: ExpertStats) -> torch.Tensor:
    """Summed gate-weighted output norm over the tokens routed to each expert."""
    return stats.gated_norm_sum.clone()


OBSERVED_METHODS = {"reap": reap, "frequency": frequency, "ean": ean,
                    "weighted_ean": weighted_ean}


def super_experts(stats: list[ExpertStats], num_layers: int) -> dict[int, list[int]]:
    """Experts whose largest output element is an extreme outlier, per layer, as the REAP
    reference finds them: above both the 99.5th percentile of every expert's maximum and a tenth
    of the largest, in the first 75% of the decoder layers (``num_layers`` of the model)."""
    maxima = torch.cat([s.max_activation for s in stats])
    maxima = maxima[maxima.isfinite()]  # dead experts have no maximum
    threshold = max(float(torch.quantile(maxima, 0.995)), float(maxima.max()) / 10)
    last = int(num_layers * 0.75)
    return {s.layer: (s.max_activation > threshold).nonzero().flatten().tolist()
            for s in stats if s.layer < last}


def random_saliency(num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform random scores: the control every informed method must beat."""
    return torch.rand(num_experts, generator=generator, dtype=torch.float64)


def saliency(method: str, stats: ExpertStats) -> torch.Tensor:
    """Saliency [E] (float64) of one layer's experts under an observed ``method``."""
    return OBSERVED_METHODS[method](stats)
