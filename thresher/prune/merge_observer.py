"""What the merging baselines observe: routing frequency, router-logit similarity, mean outputs.

For every MoE layer, on the calibration tokens, ``MergeObserver`` records beside pruning's
``ExpertStats`` (whose routed-token counts are the merging frequencies):

- the Gram matrix of the router logits, sum over tokens of l(x) l(x)^T with l(x) the [E] raw
  logits: expert i's "router logits" are the column of logits it gets over the tokens, and the
  cosine similarity of two columns (M-SMoE's grouping) is G_ij / sqrt(G_ii G_jj), exact over all
  tokens;
- with ``mean_outputs``, the sum over all tokens of every expert's output f_j(x) (every expert
  runs on every token, routed or not): HC-SMoE clusters the experts by these mean outputs.

The driver is pruning's (``observer.observe_layers``): one decoder layer resident at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from thresher.models.layerwise import LayerwiseModel
from thresher.prune.observer import ExpertObserver, ExpertStats, observe_layers


@dataclass
class MergeStats(ExpertStats):
    """``ExpertStats`` plus the router-logit Gram matrix and (optionally) the output sums."""

    logit_gram: torch.Tensor | None = None  # [E, E] float64: sum over tokens of l l^T
    output_sum: torch.Tensor | None = None  # [E, H] float64: sum over all tokens of f_j(x)

    def cpu(self) -> MergeStats:
        moved = {n: None if getattr(self, n) is None else getattr(self, n).cpu()
                 for n in ("count", "norm_sum", "gated_norm_sum", "max_activation", "logit_gram",
                           "output_sum")}
        return MergeStats(layer=self.layer, tokens=self.tokens, **moved)

    def frequency(self) -> torch.Tensor:
        """[E] float64: the share of routed (token, slot) pairs each expert received."""
        count = self.count.double()
        total = count.sum()
        return count / total if total > 0 else torch.full_like(count, 1.0 / count.numel())

    def logit_similarity(self) -> torch.Tensor:
        """[E, E] cosine similarity of the experts' router-logit columns over the tokens."""
        diag = self.logit_gram.diagonal().clamp_min(1e-30).sqrt()
        return self.logit_gram / (diag[:, None] * diag[None, :])

    def mean_outputs(self) -> torch.Tensor:
        """[E, H] every expert's mean output over all calibration tokens."""
        if self.output_sum is None:
            raise ValueError(f"layer {self.layer}: mean outputs were not observed")
        return self.output_sum / max(1, self.tokens)


class MergeObserver(ExpertObserver):
    """Accumulates ``MergeStats`` for one MoE layer from batches of the MoE block's input."""

    def __init__(self, adapter, layer, config, layer_idx: int, mean_outputs: bool = False):
        super().__init__(adapter, layer, config, layer_idx)
        base, n = self.stats, self.stats.num_experts
        device = base.count.device
        self.stats = MergeStats(
            layer=base.layer, tokens=0, count=base.count, norm_sum=base.norm_sum,
            gated_norm_sum=base.gated_norm_sum, max_activation=base.max_activation,
            logit_gram=torch.zeros(n, n, dtype=torch.float64, device=device),
            output_sum=(torch.zeros(n, config.hidden_size, dtype=torch.float64, device=device)
                        if mean_outputs else None))

    @torch.no_grad()
    def add_batch(self, hidden: torch.Tensor) -> None:
        super().add_batch(hidden)
        logits = self.adapter.route(self.layer, hidden, self.config).logits.double()
        self.stats.logit_gram += logits.T @ logits
        if self.stats.output_sum is not None:
            for j in range(self.stats.num_experts):
                out = self.adapter.expert_forward(self.layer, j, hidden)
                self.stats.output_sum[j] += out.double().sum(dim=0)


def observe_for_merge(model: LayerwiseModel, windows: torch.Tensor, mean_outputs: bool,
                      show_progress: bool = True,
                      offload_budget_bytes: float | None = None) -> list[MergeStats]:
    """``MergeStats`` of every MoE layer on calibration ``windows`` [N, S], in layer order."""
    observer = functools.partial(MergeObserver, mean_outputs=mean_outputs)
    return observe_layers(model, windows, None, 0, show_progress=show_progress,
                          observer_cls=observer, offload_budget_bytes=offload_budget_bytes).stats
