"""What a quantization method is to the sequential driver, and what the driver lends it per layer.

The driver walks the decoder layers, captures inputs (hooks, routing, gates) and commits weights;
a method decides, inside one layer, which inputs it needs and what each weight becomes. A method
module implements ``QuantMethod`` and registers it in ``thresher.compress.methods``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from thresher.compress.targets import InputSite, LayerParts, Target
from thresher.formats.nf4 import NF4Weight
from thresher.formats.quantized import QuantizedWeight
from thresher.formats.registry import format_for
from thresher.quant.grid import GridSpec

Quantized = QuantizedWeight | NF4Weight
# Receives one site's input for one calibration batch: [tokens, columns] (or [batch, seq,
# columns]) and, for a routed expert, the gate value of each of its tokens.
Sink = Callable[[InputSite, torch.Tensor, torch.Tensor | None], None]


@dataclass
class LayerRecord:
    """What happened in one decoder layer (for the report)."""

    index: int
    seconds: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)  # target key -> relative weight error
    gptq_loss: float = 0.0
    fallback_experts: list[int] = field(default_factory=list)
    expert_tokens: dict[int, float] = field(default_factory=dict)  # effective calibration tokens
    expert_shrink: dict[str, float] = field(default_factory=dict)  # site -> GPTQ diag_shrink
    awq_alpha: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0  # peak since the stage began (resources.peak_rss_mb)
    peak_device_mb: float | None = None  # CUDA: likewise (resources.device_peak_mb); CPU: None

    @property
    def mean_error(self) -> float:
        return sum(self.errors.values()) / max(1, len(self.errors))

    def too_few_tokens(self, site: InputSite, tokens: float, min_tokens: int) -> bool:
        """Record how many (effective) calibration tokens a routed expert's site saw; True (and
        the expert counted as a fallback) when they are fewer than ``min_tokens``. Always False
        for a site every token reads."""
        if site.expert is None:
            return False
        self.expert_tokens[site.expert] = tokens
        if tokens >= min_tokens:
            return False
        if site.expert not in self.fallback_experts:
            self.fallback_experts.append(site.expert)
        return True


@dataclass
class LayerJob:
    """One decoder layer as the driver lends it to a method.

    ``capture(sites, sink)`` runs the layer on every calibration batch (with the weights as they
    are now) and hands ``sink`` each site's input; ``capture(sites, sink, all_tokens=True)``
    hands a routed expert's site every token, with no gate (the layer's output still uses the
    real routing); ``commit(target, q)`` writes q's dequantized value into the layer and keeps q
    for the checkpoint. Weights committed earlier in the layer are quantized in every later
    capture.
    """

    parts: LayerParts
    record: LayerRecord
    capture: Callable[..., None]  # (sites, sink, all_tokens=False)
    commit: Callable[[Target, Quantized], None]
    position_embeddings: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    progress: Callable[[list, str], Iterable]  # wraps a loop in a progress bar
    store_dtype: torch.dtype  # the dtype the checkpoint holds float weights in
    # the layer's attention mask for hidden [B, S, H] (None: causal; gpt-oss: sliding or full)
    attention_mask: Callable[[torch.Tensor], torch.Tensor | None] = lambda hidden: None


class LayerPass(Protocol):
    """What the sequential driver runs layer by layer: a quantization method, or a pass that
    only measures (``bits: auto``'s sensitivity probe, which commits nothing)."""

    name: ClassVar[str]  # for progress bars and errors
    calibrated: ClassVar[bool]  # needs calibration activations

    def quantize_layer(self, job: LayerJob) -> None:
        """Handle every target of ``job.parts`` (runs without autograd); a method commits a
        quantized value for each."""
        ...


class QuantMethod(LayerPass, Protocol):
    """A quantization method: built from its recipe stage, it quantizes one layer at a time."""

    name: ClassVar[str]  # the recipe's ``method``
    format: str  # the checkpoint format written (a key of formats.registry.FORMATS)
    grid: GridSpec | None  # the integer grid weights are rounded to (None: not a uniform grid)

    def __init__(self, stage: Any) -> None: ...

    def quantization_config(self, skip: list[str]) -> dict:
        """The ``quantization_config`` of config.json; ``skip`` lists modules left in 16 bits."""
        ...


def grid_spec(bits: int, sym: bool, fmt: str, scale_search: str = "minmax") -> GridSpec:
    """The grid a method fits, with the smallest zero point ``fmt`` stores (GPTQ v1: 1)."""
    return GridSpec(bits=bits, sym=sym, min_zero=format_for(fmt).min_zero,
                    scale_search=scale_search)  # type: ignore[arg-type]
