"""M-SMoE's grouping ("Merge, then compress", Li et al., 2023), as the REAP paper runs it.

The ``n`` most frequently routed experts of a layer become the leaders ("dominant experts") of
``n`` groups; every other expert joins the leader whose router logits over the calibration tokens
are most similar to its own (cosine similarity of the logit columns, the REAP reference's
``router_logits`` similarity with ``cosine`` distance). The groups are then merged by
frequency-weighted averaging after aligning every member's neurons to its leader's
(``merge.align_to_leader``).

One deviation from the reference: it picks dominant experts globally (at least one per layer,
the rest by frequency across layers), so layers keep different numbers of experts; thresher picks
them per layer, so every layer keeps ``n`` and the checkpoint stays loadable by transformers and
vLLM (as REAP's own pruning is uniform across layers).
"""

from __future__ import annotations

import torch


def leaders_by_frequency(frequency: torch.Tensor, n: int) -> list[int]:
    """The ``n`` most frequently routed experts (ties: the lower index), ascending."""
    order = torch.argsort(-frequency, stable=True)
    return sorted(order[:n].tolist())


def group_around_leaders(frequency: torch.Tensor, similarity: torch.Tensor,
                         n: int) -> list[list[int]]:
    """``n`` groups, each led by one of the ``n`` most used experts (its first member), the others
    joining the leader they are most similar to (``similarity`` [E, E]; ties: the lower leader)."""
    leaders = leaders_by_frequency(frequency, n)
    groups = {leader: [leader] for leader in leaders}
    lead = torch.tensor(leaders)
    for e in range(frequency.numel()):
        if e in groups:
            continue
        best = leaders[int(torch.argmax(similarity[e, lead]))]  # argmax: first of equal maxima
        groups[best].append(e)
    return [groups[leader] for leader in leaders]
