"""What REAP and its baselines observe: per-expert routing and output statistics, layer by layer.

For every MoE layer, on the calibration tokens, the observer records for each expert j

- how many tokens were routed to it (j in the top-k of the raw router logits),
- the sum over those tokens of ||f_j(x)||_2, the L2 norm of the expert's output before gating,
- the sum over those tokens of g_j(x) * ||f_j(x)||_2, with g_j(x) REAP's gate value: the fp32
  softmax over all experts, divided by the top-k sum when the config asks for renormalization
  (``norm_topk_prob``), as the REAP reference code does.

Expert outputs are computed only for the tokens routed to each expert, so the cost is about
top_k / num_experts of running every expert on every token. ``ExpertObserver`` holds the math for
one layer; ``observe_experts`` is the sequential driver: one decoder layer resident at a time, the
outputs of layer L (unpruned) feeding layer L+1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from thresher.models.adapters import Adapter
from thresher.models.layerwise import LayerwiseModel

log = logging.getLogger(__name__)


@dataclass
class ExpertStats:
    """Per-expert sums over the calibration tokens of one MoE layer."""

    layer: int
    tokens: int  # calibration tokens that reached the layer
    count: torch.Tensor  # [E] int64: tokens routed to each expert
    norm_sum: torch.Tensor  # [E] float64: sum of ||f_j(x)|| over routed tokens
    gated_norm_sum: torch.Tensor  # [E] float64: sum of g_j(x) * ||f_j(x)|| over routed tokens

    @classmethod
    def empty(cls, layer: int, num_experts: int) -> ExpertStats:
        return cls(layer=layer, tokens=0,
                   count=torch.zeros(num_experts, dtype=torch.int64),
                   norm_sum=torch.zeros(num_experts, dtype=torch.float64),
                   gated_norm_sum=torch.zeros(num_experts, dtype=torch.float64))

    @property
    def num_experts(self) -> int:
        return self.count.numel()

    def dead_experts(self) -> list[int]:
        """Experts no calibration token was routed to."""
        return (self.count == 0).nonzero().flatten().tolist()


class ExpertObserver:
    """Accumulates ``ExpertStats`` for one MoE layer from batches of the MoE block's input."""

    def __init__(self, adapter: Adapter, layer: nn.Module, config, layer_idx: int):
        self.adapter = adapter
        self.layer = layer
        self.config = config
        self.renormalize = adapter.norm_topk_prob(config)
        self.stats = ExpertStats.empty(layer_idx, adapter.num_experts(config))

    def gates(self, probs: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """REAP's g_j(x) for each selected expert: softmax value, renormalized over the top-k if
        the config says so. probs [T, E] fp32, top_k_index [T, k] -> [T, k]."""
        g = probs.gather(-1, top_k_index)
        if self.renormalize:
            g = g / g.sum(dim=-1, keepdim=True)
        return g

    @torch.no_grad()
    def add_batch(self, hidden: torch.Tensor) -> None:
        """Observe tokens ``hidden`` [T, H], the input of the layer's MoE block."""
        routing = self.adapter.route(self.layer, hidden, self.config)
        gates = self.gates(routing.probs, routing.top_k_index)
        s = self.stats
        s.tokens += hidden.shape[0]
        for j in range(s.num_experts):
            token, slot = (routing.top_k_index == j).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            norm = self.adapter.expert_forward(self.layer, j, hidden[token]).double().norm(dim=-1)
            s.count[j] += token.numel()
            s.norm_sum[j] += norm.sum()
            s.gated_norm_sum[j] += (gates[token, slot].double() * norm).sum()


@torch.no_grad()
def observe_experts(model: LayerwiseModel, windows: torch.Tensor, batch_size: int = 8,
                    show_progress: bool = True,
                    observer_cls: type[ExpertObserver] = ExpertObserver) -> list[ExpertStats]:
    """Run calibration ``windows`` [N, S] through ``model`` one decoder layer at a time and return
    the statistics of every MoE layer, in layer order. ``observer_cls`` is the per-layer
    accumulator (the observer benchmark passes one that runs every expert on every token)."""
    adapter, config = model.adapter, model.config
    model.load_outer()
    hidden = [model.embed(batch) for batch in windows.split(batch_size)]
    results: list[ExpertStats] = []
    for i in range(model.num_layers):
        layer = model.load_layer(i)
        observer = observer_cls(adapter, layer, config, i) if adapter.is_moe_layer(layer) else None
        handle = None
        if observer is not None:
            def capture(_module: nn.Module, args: tuple, obs: ExpertObserver = observer) -> None:
                obs.add_batch(args[0].reshape(-1, args[0].shape[-1]))

            handle = adapter.mlp(layer).register_forward_pre_hook(capture)
        try:
            for b in tqdm(range(len(hidden)), desc=f"observe layer {i}", unit="batch",
                          disable=not show_progress, leave=False):
                hidden[b] = model.layer_forward(i, hidden[b])
        finally:
            if handle is not None:
                handle.remove()
            model.release_layer(i)
        if observer is not None:
            results.append(observer.stats)
            log.debug("layer %d: routed counts %s", i, observer.stats.count.tolist())
    return results
