"""What REAP and its baselines observe: per-expert routing and output statistics, layer by layer.

For every MoE layer, on the calibration tokens, the observer records for each expert j

- how many tokens were routed to it (j in the top-k of the raw router logits),
- the sum over those tokens of ||f_j(x)||_2, the L2 norm of the expert's output before gating,
- the sum over those tokens of g_j(x) * ||f_j(x)||_2, with g_j(x) REAP's gate value: for softmax
  routers the fp32 softmax over all experts, divided by the top-k sum when the config asks for
  renormalization (``norm_topk_prob``), as the REAP reference code does; for sigmoid routers
  (GLM-4.5) the gate value the forward multiplies by (``Adapter.saliency_gates``),
- the largest element of f_j(x) over those tokens (the reference's ``max_activations``, which
  finds "super experts").

``observe_layers`` can also hold out calibration windows and record, per MoE layer, a
``LayerProbe`` of them (``thresher.prune.reconstruction``): what the local reconstruction error of
``auto`` and of damage-based budgets is measured on.

Expert outputs are computed only for the tokens routed to each expert, so the cost is about
top_k / num_experts of running every expert on every token. ``ExpertObserver`` holds the math for
one layer; ``observe_experts`` is the sequential driver: one decoder layer resident at a time, the
outputs of layer L (unpruned) feeding layer L+1. On a GPU (the ``LayerwiseModel``'s device) the
statistics accumulate on the device and come back to the host when the layer is done; probes go
to the host batch by batch; the activations between layers stay on the device within a budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from thresher.models.adapters import Adapter, Routing
from thresher.models.device import ActivationStore, activation_budget
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.reconstruction import LayerProbe, ProbeRecorder

log = logging.getLogger(__name__)


@dataclass
class ExpertStats:
    """Per-expert sums over the calibration tokens of one MoE layer."""

    layer: int
    tokens: int  # calibration tokens that reached the layer
    count: torch.Tensor  # [E] int64: tokens routed to each expert
    norm_sum: torch.Tensor  # [E] float64: sum of ||f_j(x)|| over routed tokens
    gated_norm_sum: torch.Tensor  # [E] float64: sum of g_j(x) * ||f_j(x)|| over routed tokens
    max_activation: torch.Tensor | None = None  # [E] float64: largest element of f_j(x), routed

    def __post_init__(self) -> None:
        if self.max_activation is None:
            self.max_activation = torch.full((self.num_experts,), float("-inf"),
                                             dtype=torch.float64, device=self.count.device)

    @classmethod
    def empty(cls, layer: int, num_experts: int,
              device: torch.device | str = "cpu") -> ExpertStats:
        return cls(layer=layer, tokens=0,
                   count=torch.zeros(num_experts, dtype=torch.int64, device=device),
                   norm_sum=torch.zeros(num_experts, dtype=torch.float64, device=device),
                   gated_norm_sum=torch.zeros(num_experts, dtype=torch.float64, device=device))

    def cpu(self) -> ExpertStats:
        """These statistics in host memory (where pruning plans and reports read them)."""
        tensors = ("count", "norm_sum", "gated_norm_sum", "max_activation")
        if all(getattr(self, n).device.type == "cpu" for n in tensors):
            return self
        return ExpertStats(layer=self.layer, tokens=self.tokens,
                           **{n: getattr(self, n).cpu() for n in tensors})

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
        device = adapter.router(layer).weight.device
        self.stats = ExpertStats.empty(layer_idx, adapter.num_experts(config), device)

    def gates(self, routing: Routing) -> torch.Tensor:
        """REAP's g_j(x) [T, k] for each selected expert (``Adapter.saliency_gates``)."""
        return self.adapter.saliency_gates(routing, self.config)

    @torch.no_grad()
    def add_batch(self, hidden: torch.Tensor) -> None:
        """Observe tokens ``hidden`` [T, H], the input of the layer's MoE block."""
        routing = self.adapter.route(self.layer, hidden, self.config)
        gates = self.gates(routing)
        s = self.stats
        s.tokens += hidden.shape[0]
        for j in range(s.num_experts):
            token, slot = (routing.top_k_index == j).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            out = self.adapter.expert_forward(self.layer, j, hidden[token]).double()
            norm = out.norm(dim=-1)
            s.max_activation[j] = max(s.max_activation[j], out.max())
            s.count[j] += token.numel()
            s.norm_sum[j] += norm.sum()
            s.gated_norm_sum[j] += (gates[token, slot].double() * norm).sum()


@dataclass
class Observation:
    """Saliency statistics of every MoE layer, and probes for local reconstruction errors:
    ``search`` on the saliency windows, ``heldout`` on the windows held out from saliency."""

    stats: list[ExpertStats]
    search: dict[int, LayerProbe]
    heldout: dict[int, LayerProbe]
    heldout_windows: int = 0
    heldout_ids: torch.Tensor | None = None  # [N, S] the held-out windows (end-to-end damage)


class _MoECapture:
    """The MoE block's pre-hook: saliency batches go to the observer, the first tokens of every
    batch to the probe of its split (saliency or held-out)."""

    def __init__(self, observer: ExpertObserver, probes: tuple[ProbeRecorder, ...] | None,
                 n_saliency: int):
        self.observer, self.probes, self.n_saliency = observer, probes, n_saliency
        self.batch, self.taken = 0, 0

    def __call__(self, _module: nn.Module, args: tuple) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        if self.batch < self.n_saliency:
            self.observer.add_batch(x)
        if self.probes is not None:
            self.taken = self.probes[self.batch >= self.n_saliency].add_batch(x)

    def layer_output(self, out: torch.Tensor) -> None:
        if self.taken:
            flat = out.reshape(-1, out.shape[-1])[:self.taken]
            self.probes[self.batch >= self.n_saliency].add_layer_output(flat)
            self.taken = 0


@torch.no_grad()
def observe_experts(model: LayerwiseModel, windows: torch.Tensor, batch_size: int = 8,
                    show_progress: bool = True,
                    observer_cls: type[ExpertObserver] = ExpertObserver,
                    offload_budget_bytes: float | None = None) -> list[ExpertStats]:
    """Run calibration ``windows`` [N, S] through ``model`` one decoder layer at a time and return
    the statistics of every MoE layer, in layer order. ``observer_cls`` is the per-layer
    accumulator (the observer benchmark passes one that runs every expert on every token)."""
    return observe_layers(model, windows, None, 0, batch_size, show_progress, observer_cls,
                          offload_budget_bytes).stats


@torch.no_grad()
def observe_layers(model: LayerwiseModel, windows: torch.Tensor, heldout: torch.Tensor | None,
                   probe_tokens: int, batch_size: int = 8, show_progress: bool = True,
                   observer_cls: type[ExpertObserver] = ExpertObserver,
                   offload_budget_bytes: float | None = None) -> Observation:
    """``observe_experts`` on ``windows``, and, when ``heldout`` windows are given, probes of at
    most ``probe_tokens`` tokens of each MoE layer on the saliency and on the held-out windows.
    Activations beyond ``offload_budget_bytes`` (default: ``device.activation_budget``) wait
    in host memory."""
    adapter, config = model.adapter, model.config
    model.load_outer()
    budget = (activation_budget(model.device, None) if offload_budget_bytes is None
              else offload_budget_bytes)
    hidden = ActivationStore(model.device, budget)
    for batch in windows.split(batch_size):
        hidden.append(model.embed(batch))
    n_saliency = len(hidden)
    if heldout is not None:
        for batch in heldout.split(batch_size):
            hidden.append(model.embed(batch))
    result = Observation(stats=[], search={}, heldout={},
                         heldout_windows=0 if heldout is None else len(heldout),
                         heldout_ids=heldout)
    for i in range(model.num_layers):
        layer = model.load_layer(i)
        capture = None
        if adapter.is_moe_layer(layer):
            probes = None if heldout is None else tuple(
                ProbeRecorder(adapter, layer, config, i, probe_tokens) for _ in range(2))
            capture = _MoECapture(observer_cls(adapter, layer, config, i), probes, n_saliency)
            handle = adapter.mlp(layer).register_forward_pre_hook(capture)
        try:
            for b in tqdm(range(len(hidden)), desc=f"observe layer {i}", unit="batch",
                          disable=None if show_progress else True, leave=False):  # terminal only
                if capture is not None:
                    capture.batch = b
                out = model.layer_forward(i, hidden[b])
                hidden[b] = out
                if capture is not None:
                    capture.layer_output(out)
        finally:
            if capture is not None:
                handle.remove()
            model.release_layer(i)
        if capture is not None:
            result.stats.append(capture.observer.stats.cpu())
            if capture.probes is not None:
                result.search[i] = capture.probes[0].probe()
                result.heldout[i] = capture.probes[1].probe()
            log.debug("layer %d: routed counts %s", i, capture.observer.stats.count.tolist())
    return result
