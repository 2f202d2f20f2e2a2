"""The sequential (layer-by-layer) calibration driver shared by every quantization method.

Walks the decoder layers in order with ``LayerwiseModel``: only the current layer's weights and
the calibration activations between layers are in memory. For each layer it lends the method a
``LayerJob``: a capture of the inputs each weight reads (hooks on the linear layers; for routed
experts, a pre-hook on the fused experts module that sees exactly the routing the forward uses,
with each token's gate value), and a commit that writes a quantized weight's dequantized value
back into the layer. The layer's outputs are then computed *with the quantized weights* as the
next layer's inputs. Hooks, routing and I/O live here; what to capture and how to quantize live in
the method modules (``compress/methods/``), and the algorithms (``gptq.py``, ``awq.py``) only see
tensors.

On a device (``Compute``: CUDA, or the CPU), the layer computes there, the calibration activations
stay there within the activation budget (``ActivationStore``), and each finished layer and its
quantized tensors come back to the host before the callback writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm

from thresher.compress.methods.protocol import LayerJob, LayerPass, LayerRecord, Quantized, Sink
from thresher.compress.targets import InputSite, LayerParts, Target
from thresher.models.device import ActivationStore, activation_budget
from thresher.models.layerwise import LayerwiseModel
from thresher.quant.grid import relative_error
from thresher.resources import device_peak_mb, peak_rss_mb

log = logging.getLogger(__name__)

LayerCallback = Callable[[int, nn.Module, dict[str, Quantized]], None]
T = TypeVar("T")


class _Stop(Exception):
    """Raised by a hook once a capture has everything it needs from the layer's forward."""


def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> torch.Tensor:
    return args[pos] if len(args) > pos else kwargs[name]


class SequentialQuantizer:
    """Quantizes a checkpoint layer by layer; ``run`` hands each finished layer to a callback."""

    def __init__(self, lw: LayerwiseModel, method: LayerPass, keep_16bit: list[str],
                 windows: torch.Tensor | None = None, batch_size: int = 8,
                 store_dtype: torch.dtype = torch.float32, show_progress: bool = True,
                 offload_budget_bytes: float | None = None):
        """``lw``'s device is where the layers compute; ``offload_budget_bytes`` bounds the
        activations kept there (default: ``device.activation_budget`` for that device)."""
        self.lw = lw
        self.method = method
        self.keep = set(keep_16bit)
        self.windows = windows
        self.batch_size = batch_size
        self.store_dtype = store_dtype
        self.show_progress = show_progress
        self.budget = (activation_budget(lw.device, None) if offload_budget_bytes is None
                       else offload_budget_bytes)
        self.offloaded = 0  # most activation batches held in host memory at once

    def run(self, on_layer: LayerCallback) -> list[LayerRecord]:
        calibrated = self.method.calibrated
        device = self.lw.device
        hidden = ActivationStore(device, self.budget)
        if calibrated:
            if self.windows is None:
                raise ValueError(f"{self.method.name} needs calibration windows")
            self.lw.load_outer()
            for b in self.windows.split(self.batch_size):
                hidden.append(self.lw.embed(b))
            self.offloaded = hidden.offloaded
        records = []
        layers = tqdm(range(self.lw.num_layers), desc=f"quantize {self.method.name}",
                      unit="layer", disable=not self.show_progress)
        for i in layers:
            start = time.perf_counter()
            layer = self.lw.load_layer(i)
            record = LayerRecord(index=i)
            parts = LayerParts(self.lw.adapter, layer, i, self.keep)
            quantized: dict[str, Quantized] = {}
            job = LayerJob(parts=parts, record=record,
                           capture=partial(self._collect, parts, hidden),
                           commit=partial(self._commit, record, quantized),
                           position_embeddings=self.lw.position_embeddings,
                           progress=self._progress, store_dtype=self.store_dtype,
                           attention_mask=partial(self.lw.adapter.layer_attention_mask,
                                                  self.lw.config, i))
            with torch.no_grad():
                self.method.quantize_layer(job)
            if calibrated:
                for b in range(len(hidden)):
                    hidden[b] = self.lw.layer_forward(i, hidden[b])
                self.offloaded = max(self.offloaded, hidden.offloaded)
            layer = self.lw.layer_to_host(i) if device.type != "cpu" else layer
            record.seconds = time.perf_counter() - start
            on_layer(i, layer, quantized)
            del quantized, parts  # freed before the next layer is read
            self.lw.release_layer(i)
            record.peak_rss_mb = peak_rss_mb()
            record.peak_device_mb = device_peak_mb(device)
            records.append(record)
            log.debug("layer %d: %.1f s, mean relative error %.3g", i, record.seconds,
                      record.mean_error)
        return records

    def _collect(self, parts: LayerParts, hidden: ActivationStore, sites: list[InputSite],
                 sink: Sink, all_tokens: bool = False) -> None:
        """Run the layer on every batch, handing each site's input (and expert gates) to sink;
        with ``all_tokens`` every expert site gets every token, ungated."""
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
                    if all_tokens:
                        xe = x if not site.down else parts.adapter.expert_hidden(
                            parts.layer, site.expert, x)
                        sink(site, xe, None)
                        continue
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

    def _commit(self, record: LayerRecord, out: dict[str, Quantized], t: Target,
                q: Quantized) -> None:
        """Write the dequantized weight into the layer (the next layer sees quantized outputs)."""
        deq = q.dequantize().to(t.weight.device)
        record.errors[t.key] = relative_error(t.weight, deq)
        t.weight.copy_(deq.to(t.weight.dtype))
        out[t.key] = _on_host(q)

    def _progress(self, items: list[T], desc: str) -> Iterable[T]:
        # a transient bar per layer's experts: drawn on a terminal only (disable=None), since
        # in a log file each would add its first and last states as lines
        return tqdm(items, desc=desc, leave=False, disable=None if self.show_progress else True)


def _on_host(q: Quantized) -> Quantized:
    """``q`` with every tensor in host memory (where the checkpoint writer reads them)."""
    moved = {f.name: getattr(q, f.name).cpu() for f in dataclasses.fields(q)
             if isinstance(getattr(q, f.name), torch.Tensor)
             and getattr(q, f.name).device.type != "cpu"}
    return dataclasses.replace(q, **moved) if moved else q
