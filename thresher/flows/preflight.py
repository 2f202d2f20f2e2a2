"""What a recipe asks of its model, checked before any compute.

``thresher check`` and the flow's first step read the model's config — a local directory, the
Hugging Face cache, or a demo model's spec (known without training it) — and refuse what the run
would refuse later: group sizes that do not divide a layer's inputs, prunes that leave fewer
experts than top-k, GGUF types whose blocks a weight's rows cannot hold. Each refusal names the
recipe field and the model's numbers. The same pass says, per published variant, which GGUF
files the run writes and how (``gguf_route``: handed over as they are, or rounded), and where
the evaluation text comes from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from thresher.compress.api import check_stage
from thresher.compress.methods import method_for
from thresher.data.sources import unmatched_patterns
from thresher.errors import CompressionError, DataError, ExportError, RecipeError, ThresherError
from thresher.export import check_gguf_architecture, check_gguf_widths, gguf_route
from thresher.formats.config import PackedFormat, packed_format
from thresher.models.adapters import Adapter, get_adapter
from thresher.models.inspect import count_parameters
from thresher.models.layerwise import is_mxfp4, refuse_packed
from thresher.models.loading import check_window_length
from thresher.models.source import parse_model_source
from thresher.prune.mask import experts_to_keep
from thresher.prune.merge_api import experts_after_merge
from thresher.recipe import (
    FilesSource,
    HFDatasetSource,
    MergeStage,
    QuantizeStage,
    Recipe,
    TextSource,
    Variant,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFFile:
    """One GGUF file a published variant gets: its name, type and how it is made."""

    file: str
    type: str
    how: str  # thresher.export's HANDOFF, QUANTIZED or REQUANTIZED


@dataclass
class Preflight:
    """What ``preflight`` found: where the model's shapes came from (``checked`` False when they
    could not be read here), and the GGUF files of each published variant."""

    config_source: str
    checked: bool
    gguf: dict[str, list[GGUFFile]] = field(default_factory=dict)
    parameters: int | None = None  # the base model's, where its config could be read


@dataclass
class _MetaModel:
    """A model's modules on the meta device (shapes, no weights): what ``check_stage`` reads."""

    path: Path
    adapter: Adapter
    model: nn.Module

    @property
    def num_layers(self) -> int:
        return len(self.adapter.layers(self.model))

    def layer(self, i: int) -> nn.Module:
        return self.adapter.layers(self.model)[i]


def read_model_config(model: str) -> tuple[Any | None, str]:
    """The model's config without its weights, and where it was read; None (and why) for a
    registry model or a hub model that is not in the local cache."""
    from transformers import AutoConfig

    src = parse_model_source(model)
    if src.kind == "demo":
        from thresher.data.demo_model import demo_config, demo_model_dir

        try:
            built = demo_model_dir(src.value) / "config.json"
            return demo_config(src.value), (str(built) if built.is_file() else
                                             f"demo:{src.value}'s spec (not built yet)")
        except ThresherError as err:
            raise RecipeError(f"model: {err}") from None
    if src.kind == "local":
        path = Path(src.value)
        if not (path / "config.json").is_file():
            raise RecipeError(f"model: {path} is not a model directory (no config.json)")
        return AutoConfig.from_pretrained(path), f"{path / 'config.json'}"
    if src.kind == "hub":
        try:
            return (AutoConfig.from_pretrained(src.value, local_files_only=True),
                    "the Hugging Face cache")
        except (OSError, ValueError):
            return None, (f"{src.value} is not in the Hugging Face cache here; its shapes are "
                          "checked when the run downloads it")
    return None, "a registry model; its shapes are checked when the run resolves it"


def variant_format(variant: Variant) -> tuple[PackedFormat | None, bool]:
    """The layout of a variant's weights once its stages ran (None: 16/32-bit) and whether its
    groups stay in column order (not GPTQ act-order without static groups)."""
    q: QuantizeStage | None = next((s.quantize for s in variant.stages if s.quantize), None)
    if q is None:
        return None, True
    kind = method_for(q).format
    in_order = not (getattr(q, "act_order", False) and not getattr(q, "static_groups", True))
    if q.bits == "auto":  # per-matrix widths: never one Q4_1 layout
        return PackedFormat(kind, 4, q.group_size, dynamic=(("auto", ()),)), in_order
    return PackedFormat(kind, int(q.bits), q.group_size), in_order


def gguf_plan(recipe: Recipe) -> dict[str, list[GGUFFile]]:
    """Per published variant (one with stages), the GGUF files the run writes and how."""
    if "gguf" not in recipe.publish.formats:
        return {}
    plan = {}
    for v in recipe.variants:
        if not v.stages:
            continue
        fmt, in_order = variant_format(v)
        plan[v.name] = [GGUFFile(f"{v.name}-{t}.gguf", t, gguf_route(fmt, t, in_order))
                        for t in recipe.publish.gguf_types]
    return plan


def describe_source(source: TextSource, purpose: str) -> str:
    """Where a recipe's text comes from, as true as can be said: only ``stdlib`` has a held-out
    split that thresher keeps apart from the calibration text."""
    if source == "stdlib":
        return ("the stdlib held-out split (kept apart from the train split calibration reads)"
                if purpose == "evaluation" else "the stdlib train split")
    if isinstance(source, HFDatasetSource):
        return (f"dataset {source.hf}" + (f" ({source.config})" if source.config else "")
                + f", split {source.split!r} as the recipe names it")
    assert isinstance(source, FilesSource)
    files = ", ".join(source.files)
    return f"file(s) {files}, as you chose them (a local file has no held-out split)"


def preflight(recipe: Recipe) -> Preflight:
    """Check every variant against the model's shapes, before any compute; RecipeError names
    the field and the model's numbers."""
    _check_files(recipe)
    config, where = read_model_config(recipe.model)
    result = Preflight(where, config is not None, gguf_plan(recipe))
    if config is None:
        return result
    try:
        adapter = get_adapter(config)
        config = adapter.language_config(config)  # a multimodal hub config's language model
        if not is_mxfp4(config):  # MXFP4 experts are dequantized as they are read
            packed_format(config, where)  # weights no stage can read (an FP8 hub checkpoint)
            if any(v.stages for v in recipe.variants):  # a GPTQ/AWQ/NF4 base: evaluated only
                refuse_packed(config, where)
    except ThresherError as err:
        raise RecipeError(f"model: {err}") from None
    _check_drafts(recipe, adapter, config)
    for at, seq_len in (("calibration.seq_len", recipe.calibration.seq_len),
                        ("eval.perplexity.seq_len", recipe.eval.perplexity.seq_len)):
        try:
            check_window_length(config, seq_len, f"{at}:", "the model")
        except DataError as err:
            raise RecipeError(str(err)) from None
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta = _MetaModel(Path(recipe.model), adapter, AutoModelForCausalLM.from_config(config))
    result.parameters = count_parameters(meta.model)
    seen: set[str] = set()
    for i, variant in enumerate(recipe.variants):
        experts = adapter.num_experts(config) if adapter.is_moe else 0
        for j, stage in enumerate(variant.stages):
            at = f"variants.{i}.stages.{j}"
            if stage.prune is not None:
                experts = _check_prune(stage.prune, adapter, config, experts, f"{at}.prune")
                continue
            if stage.merge is not None:
                experts = _check_merge(stage.merge, adapter, config, experts, f"{at}.merge")
                continue
            key = stage.model_dump_json()
            if key not in seen:
                seen.add(key)
                _check_quantize(stage.quantize, meta, f"{at}.quantize")
    if result.gguf:
        _check_gguf(recipe, config, meta)
    return result


def _check_files(recipe: Recipe) -> None:
    """Local calibration and evaluation files exist where the run reads them (a missing one
    failed the flow only after the base model had been evaluated and validated)."""
    for at, source in (("calibration.source", recipe.calibration.source),
                       ("eval.perplexity.source", recipe.eval.perplexity.source)):
        if isinstance(source, FilesSource) and (missing := unmatched_patterns(source)):
            raise RecipeError(f"{at}.files: {missing[0]!r} matches no file (paths are read "
                              "where the run runs, relative to its working directory)")


def _check_drafts(recipe: Recipe, adapter: Adapter, config) -> None:
    """Refuse speculative decoding for a model with recurrent (linear-attention) layers: their
    state cannot take back rejected draft tokens, so the engine does not draft for them."""
    if not adapter.linear_attention_layers(config):
        return
    asked = ["validate.draft_of_base"] if recipe.validate_.draft_of_base else []
    asked += [f"variants.{i}.validate.draft" for i, v in enumerate(recipe.variants)
              if v.validate_ is not None and v.validate_.draft is not None]
    if asked:
        raise RecipeError(f"{asked[0]}: {config.model_type} has recurrent (Gated DeltaNet) "
                          "layers, which the engine serves without speculative decoding")


def _check_prune(prune, adapter: Adapter, config, experts: int, at: str) -> int:
    if not adapter.is_moe:
        raise RecipeError(f"{at}: {config.model_type} is a dense model with no experts to prune")
    try:
        return experts_to_keep(experts, adapter.top_k(config), prune.ratio, prune.keep,
                               f"the model ({experts} experts per layer, top-{adapter.top_k(config)})")
    except CompressionError as err:
        field_ = "ratio" if prune.ratio is not None else "keep"
        raise RecipeError(f"{at}.{field_}: {err}") from None


def _check_merge(merge: MergeStage, adapter: Adapter, config, experts: int, at: str) -> int:
    if not adapter.is_moe:
        raise RecipeError(f"{at}: {config.model_type} is a dense model with no experts to merge")
    top_k = adapter.top_k(config)
    try:
        return experts_after_merge(experts, top_k, merge,
                                   f"the model ({experts} experts per layer, top-{top_k})")
    except CompressionError as err:
        field_ = "ratio" if merge.ratio is not None else "keep"
        raise RecipeError(f"{at}.{field_}: {err}") from None


def _check_quantize(stage: QuantizeStage, meta: _MetaModel, at: str) -> None:
    try:
        check_stage(stage, method_for(stage), meta)
    except CompressionError as err:
        text = str(err).removeprefix(f"{meta.path}: ")
        field_ = next((f for f in ("group_size", "keep_16bit", "bits") if f in text), None)
        raise RecipeError(f"{at}{'.' + field_ if field_ else ''}: {text}") from None


def _check_gguf(recipe: Recipe, config, meta: _MetaModel) -> None:
    try:
        check_gguf_architecture(config, recipe.model)
        widths = _matrix_widths(meta)
        for gguf_type in recipe.publish.gguf_types:
            check_gguf_widths(gguf_type, widths)
    except ExportError as err:
        raise RecipeError(f"publish.gguf_types: {err}") from None


def _matrix_widths(meta: _MetaModel) -> dict[str, int]:
    """Every weight matrix a GGUF file holds in blocks, with its row width (its inputs); the
    routers stay F32 and are left out."""
    adapter = meta.adapter
    f32 = set()
    for i in range(meta.num_layers):
        layer = meta.layer(i)
        if adapter.is_moe_layer(layer):
            f32 |= {id(p) for p in adapter.router(layer).parameters()}
        gate = adapter.shared_expert_gate(layer)
        if gate is not None:
            f32 |= {id(p) for p in gate.parameters()}
    return {name: int(p.shape[-1]) for name, p in meta.model.named_parameters()
            if p.dim() >= 2 and id(p) not in f32}
