"""The sequential (layer-by-layer) calibration driver shared by RTN, GPTQ, AWQ and NF4.

Walks the decoder layers in order with ``LayerwiseModel``: only the current layer's weights and
the calibration activations between layers are in memory. For each layer it captures the inputs
each weight reads (hooks on the linear layers; for routed experts, a pre-hook on the fused experts
module that sees exactly the routing the forward uses), runs the method, writes the dequantized
weights back into the layer, and computes the layer's outputs *with the quantized weights* as the
next layer's inputs. Hooks, routing and I/O live here; the algorithms (``gptq.py``, ``awq.py``)
only see tensors.

Routed experts: an expert's GPTQ Hessian and AWQ statistics come from the tokens routed to it,
each weighted by its gate value (squared, for the squared-error Hessian), since the expert's
output enters the layer output multiplied by that gate. An expert routed fewer than
``min_expert_tokens`` calibration tokens falls back to RTN on the same grid (GPTQ) or to no
scaling and no clipping (AWQ); the report counts these experts.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from thresher.compress.awq import (
    clip_weight,
    pseudo_quantize,
    search_clip,
    search_scale,
    weight_mean,
)
from thresher.compress.gptq import GPTQ
from thresher.compress.nf4 import NF4Weight, nf4_quantize
from thresher.compress.quantizer import GridSpec, relative_error
from thresher.compress.rtn import rtn_quantize
from thresher.compress.targets import (
    InputSite,
    LayerParts,
    ScalingGroup,
    Target,
    all_targets,
    apply_scale,
    scaling_groups,
    sequential_stages,
)
from thresher.formats.quantized import QuantizedWeight
from thresher.models.layerwise import LayerwiseModel
from thresher.recipe import QuantizeStage

log = logging.getLogger(__name__)

Quantized = QuantizedWeight | NF4Weight
LayerCallback = Callable[[int, nn.Module, dict[str, Quantized]], None]
CALIBRATED = ("gptq", "awq")


@dataclass
class LayerRecord:
    """What happened in one decoder layer (for the report)."""

    index: int
    seconds: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)  # target key -> relative weight error
    gptq_loss: float = 0.0
    fallback_experts: list[int] = field(default_factory=list)
    expert_tokens: dict[int, int] = field(default_factory=dict)
    awq_alpha: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0  # the process's peak resident set so far, after this layer

    @property
    def mean_error(self) -> float:
        return sum(self.errors.values()) / max(1, len(self.errors))


class _Stop(Exception):
    """Raised by a hook once a capture has everything it needs from the layer's forward."""


def grid_spec(stage: QuantizeStage) -> GridSpec:
    """The grid a stage quantizes on; GPTQ-format artifacts (rtn, gptq) need zero >= 1."""
    sym = stage.sym if stage.sym is not None else stage.method == "gptq"
    return GridSpec(bits=stage.bits, sym=sym, min_zero=1 if stage.method in ("rtn", "gptq") else 0)


def _add_to_hessian(hessians: dict[str, GPTQ], site: InputSite, x: torch.Tensor,
                    gate: torch.Tensor | None) -> None:
    """GPTQ's objective is squared error, so a routed token counts with its gate squared."""
    hessians[site.name].add_batch(x, None if gate is None else gate**2)


def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> torch.Tensor:
    return args[pos] if len(args) > pos else kwargs[name]


class SequentialQuantizer:
    """Quantizes a checkpoint layer by layer; ``run`` hands each finished layer to a callback."""

    def __init__(self, lw: LayerwiseModel, stage: QuantizeStage,
                 windows: torch.Tensor | None = None, batch_size: int = 8,
                 nf4_dtype: torch.dtype = torch.float32, show_progress: bool = True):
        self.lw = lw
        self.stage = stage
        self.spec = grid_spec(stage)
        self.windows = windows
        self.batch_size = batch_size
        self.nf4_dtype = nf4_dtype
        self.show_progress = show_progress
        self.keep = set(stage.keep_16bit)

    @property
    def calibrated(self) -> bool:
        return self.stage.method in CALIBRATED

    def run(self, on_layer: LayerCallback) -> list[LayerRecord]:
        hidden: list[torch.Tensor] = []
        if self.calibrated:
            if self.windows is None:
                raise ValueError(f"{self.stage.method} needs calibration windows")
            self.lw.load_outer()
            hidden = [self.lw.embed(b) for b in self.windows.split(self.batch_size)]
        records = []
        layers = tqdm(range(self.lw.num_layers), desc=f"quantize {self.stage.method}",
                      unit="layer", disable=not self.show_progress)
        for i in layers:
            start = time.perf_counter()
            layer = self.lw.load_layer(i)
            record = LayerRecord(index=i)
            parts = LayerParts(self.lw.adapter, layer, i, self.keep)
            method = getattr(self, f"_{self.stage.method}_layer")
            quantized = method(parts, hidden, record)
            if self.calibrated:
                hidden = [self.lw.layer_forward(i, h) for h in hidden]
            record.seconds = time.perf_counter() - start
            on_layer(i, layer, quantized)
            del quantized, parts  # freed before the next layer is read
            self.lw.release_layer(i)
            record.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            records.append(record)
            log.debug("layer %d: %.1f s, mean relative error %.3g", i, record.seconds,
                      record.mean_error)
        return records

    # -- capture ------------------------------------------------------------------------------

    def _collect(self, parts: LayerParts, sites: list[InputSite], hidden: list[torch.Tensor],
                 sink: Callable[[InputSite, torch.Tensor, torch.Tensor | None], None]) -> None:
        """Run the layer on every batch, handing each site's input (and expert gates) to sink."""
        handles = []

        def linear_hook(site: InputSite):
            def hook(module, args, kwargs):
                sink(site, _arg(args, kwargs, 0, "input"), None)
            return hook

        def experts_hook(routed: list[InputSite]):
            def hook(module, args, kwargs):
                x = _arg(args, kwargs, 0, "hidden_states")
                index = _arg(args, kwargs, 1, "top_k_index")
                weights = _arg(args, kwargs, 2, "top_k_weights")
                for site in routed:
                    mask = index == site.expert
                    rows = mask.any(dim=1)
                    gate = (weights * mask).sum(dim=1)[rows].float()
                    xe = x[rows]
                    if site.down:
                        xe = parts.adapter.expert_hidden(parts.layer, site.expert, xe)
                    sink(site, xe, gate)
            return hook

        routed = [s for s in sites if s.expert is not None]
        for site in sites:
            if site.expert is None:
                handles.append(site.module.register_forward_pre_hook(linear_hook(site),
                                                                     with_kwargs=True))
        if routed:
            handles.append(routed[0].module.register_forward_pre_hook(experts_hook(routed),
                                                                      with_kwargs=True))
        attention_modules = {id(m) for m in parts.attn.values()}
        if all(id(s.module) in attention_modules for s in sites):
            def stop(module, args, output):
                raise _Stop
            handles.append(parts.adapter.attention(parts.layer).register_forward_hook(stop))
        try:
            for h in hidden:
                with contextlib.suppress(_Stop):
                    self.lw.layer_forward(parts.idx, h)
        finally:
            for handle in handles:
                handle.remove()

    def _commit(self, t: Target, q: Quantized, record: LayerRecord,
                out: dict[str, Quantized]) -> None:
        """Write the dequantized weight into the layer (the next layer sees quantized outputs)."""
        deq = q.dequantize()
        record.errors[t.key] = relative_error(t.weight, deq)
        t.weight.copy_(deq.to(t.weight.dtype))
        out[t.key] = q

    def _progress(self, items: list, desc: str):
        return tqdm(items, desc=desc, leave=False, disable=not self.show_progress)

    # -- methods ------------------------------------------------------------------------------

    @torch.no_grad()
    def _rtn_layer(self, parts: LayerParts, hidden, record: LayerRecord) -> dict[str, Quantized]:
        out: dict[str, Quantized] = {}
        for t in self._progress(all_targets(parts), f"layer {parts.idx} rtn"):
            self._commit(t, rtn_quantize(t.weight, self.spec, self.stage.group_size), record, out)
        return out

    @torch.no_grad()
    def _nf4_layer(self, parts: LayerParts, hidden, record: LayerRecord) -> dict[str, Quantized]:
        out: dict[str, Quantized] = {}
        for t in self._progress(all_targets(parts), f"layer {parts.idx} nf4"):
            q = nf4_quantize(t.weight, self.stage.double_quant, self.nf4_dtype)
            self._commit(t, q, record, out)
        return out

    @torch.no_grad()
    def _gptq_layer(self, parts: LayerParts, hidden: list[torch.Tensor],
                    record: LayerRecord) -> dict[str, Quantized]:
        st = self.stage
        out: dict[str, Quantized] = {}
        for stage in sequential_stages(parts):
            hessians = {s.name: GPTQ(s.columns, s.name) for s in stage}

            self._collect(parts, stage, hidden, partial(_add_to_hessian, hessians))
            for site in self._progress(stage, f"layer {parts.idx} gptq"):
                h = hessians.pop(site.name)
                if site.expert is not None:
                    record.expert_tokens[site.expert] = h.tokens
                fallback = site.expert is not None and h.tokens < st.min_expert_tokens
                if fallback and site.expert not in record.fallback_experts:
                    record.fallback_experts.append(site.expert)
                for t in site.targets:
                    if fallback:
                        q = rtn_quantize(t.weight, self.spec, st.group_size)
                    else:
                        q, loss = h.quantize(t.weight, self.spec, st.group_size, st.act_order,
                                             st.static_groups, st.damp_percent, st.block_size)
                        record.gptq_loss += loss
                    self._commit(t, q, record, out)
        return out

    @torch.no_grad()
    def _awq_layer(self, parts: LayerParts, hidden: list[torch.Tensor],
                   record: LayerRecord) -> dict[str, Quantized]:
        st = self.stage
        groups = scaling_groups(parts)
        # Folding a scale leaves the float layer unchanged, so one capture serves every group.
        inputs = self._capture(parts, [g.site for g in groups], hidden)
        for group in self._progress(groups, f"layer {parts.idx} awq"):
            self._awq_scale(parts, group, *inputs.pop(group.site.name), record)
        if st.clip:
            self._awq_clip(parts, hidden, record)
        out: dict[str, Quantized] = {}
        for t in all_targets(parts):
            self._commit(t, rtn_quantize(t.weight, self.spec, st.group_size), record, out)
        return out

    def _capture(self, parts: LayerParts, sites: list[InputSite], hidden: list[torch.Tensor]
                 ) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor | None]]]:
        """Every site's inputs (per batch, or per batch of routed tokens) and expert gates."""
        captured: dict[str, tuple[list, list]] = {s.name: ([], []) for s in sites}

        def keep(s: InputSite, x: torch.Tensor, gate: torch.Tensor | None) -> None:
            captured[s.name][0].append(x.float())
            captured[s.name][1].append(gate)

        self._collect(parts, sites, hidden, keep)
        return captured

    def _awq_scale(self, parts: LayerParts, group: ScalingGroup, xs: list[torch.Tensor],
                   gates: list[torch.Tensor | None], record: LayerRecord) -> None:
        if group.site.expert is not None:
            tokens = sum(x.shape[0] for x in xs)
            record.expert_tokens[group.site.expert] = tokens
            if tokens < self.stage.min_expert_tokens:
                if group.site.expert not in record.fallback_experts:
                    record.fallback_experts.append(group.site.expert)
                return
        columns = group.site.columns
        x_mean = torch.cat([x.reshape(-1, columns) for x in xs]).abs().mean(dim=0)
        targets = group.targets
        w_mean = weight_mean([t.weight for t in targets], self.stage.group_size)
        inspect = self._inspector(parts, group, xs, gates)
        reference = inspect()
        originals = [t.weight.clone() for t in targets]

        def loss(s: torch.Tensor) -> float:
            for t, w in zip(targets, originals, strict=True):
                t.weight.copy_(pseudo_quantize(w * s, self.spec, self.stage.group_size) / s)
            err = (inspect() - reference).pow(2).mean()
            for t, w in zip(targets, originals, strict=True):
                t.weight.copy_(w)
            return float(err)

        best = search_scale(x_mean, w_mean, loss, self.stage.duo_scaling)
        record.awq_alpha[group.name] = best.alpha
        apply_scale(group, best.scale)

    def _inspector(self, parts: LayerParts, group: ScalingGroup, xs: list[torch.Tensor],
                   gates: list[torch.Tensor | None]) -> Callable[[], torch.Tensor]:
        """A function computing the group's output on the captured inputs with current weights."""
        if group.inspect == "attention":
            attn = group.block
            pes = [self.lw.position_embeddings(x) for x in xs]

            def run_attention() -> torch.Tensor:
                return torch.cat([attn(hidden_states=x, position_embeddings=pe,
                                       attention_mask=None)[0].reshape(-1, x.shape[-1])
                                  for x, pe in zip(xs, pes, strict=True)])
            return run_attention
        if group.inspect == "module":
            block = group.block

            def run_block() -> torch.Tensor:
                return torch.cat([block(x).reshape(-1, x.shape[-1]) for x in xs])
            return run_block
        x = torch.cat([x.reshape(-1, group.site.columns) for x in xs])
        gate = None if gates[0] is None else torch.cat(gates).unsqueeze(1)

        def run_linear() -> torch.Tensor:
            y = torch.cat([x @ t.weight.T for t in group.targets], dim=1)
            return y if gate is None else y * gate
        return run_linear

    def _awq_clip(self, parts: LayerParts, hidden: list[torch.Tensor], record: LayerRecord
                  ) -> None:
        """Search each weight's clipping range on its (scaled) input; q/k are left unclipped."""
        sites = [s for stage in sequential_stages(parts) for s in stage]
        inputs: dict[str, list[torch.Tensor]] = {s.name: [] for s in sites}

        def keep(site: InputSite, x: torch.Tensor, gate: torch.Tensor | None) -> None:
            x = x.reshape(-1, site.columns).float()
            inputs[site.name].append(x if gate is None else x * gate.unsqueeze(1))

        self._collect(parts, sites, hidden, keep)
        for site in self._progress(sites, f"layer {parts.idx} awq clip"):
            if site.expert is not None and site.expert in record.fallback_experts:
                continue
            x = torch.cat(inputs.pop(site.name))
            for t in site.targets:
                if t.role in ("q_proj", "k_proj"):
                    continue
                max_val = search_clip(t.weight, x, self.spec, self.stage.group_size)
                t.weight.copy_(clip_weight(t.weight, max_val, self.stage.group_size))
