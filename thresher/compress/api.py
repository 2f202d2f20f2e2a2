"""The quantize stage: a model directory in, a complete quantized checkpoint directory out.

``quantize_model`` checks every option against the model before any compute, streams the model
through the sequential driver one decoder layer at a time, packs each finished layer into the
method's standard format (RTN and GPTQ: GPTQ v1; AWQ: gemm at 4 bits, GPTQ v1 at other widths;
NF4: bitsandbytes) under hub-canonical per-expert names, and builds the directory beside
``out_dir`` (``paths.build_dir_atomically``), so a crash never leaves a partial artifact there. Wall time and peak memory come from
``resources.measure``, the definition the flows and benchmarks report too. ``device`` and
``offload_budget_gb`` say where it computes (``models.device``); they are execution settings: the
artifact is the same up to floating-point order on any device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from thresher.compress.driver import LayerCallback, SequentialQuantizer
from thresher.compress.methods import method_for
from thresher.compress.methods.gptq import GPTQMethod
from thresher.compress.methods.protocol import LayerRecord, QuantMethod
from thresher.compress.mixed import Allocation, SensitivityProbe, allocate, budget_bits
from thresher.compress.targets import ALWAYS_16BIT, OPTIONAL_16BIT, LayerParts, all_targets
from thresher.errors import ArtifactError, CompressionError
from thresher.formats.artifact import PROVENANCE, QUANTIZE_REPORT
from thresher.formats.base import CheckpointFormat
from thresher.formats.registry import format_for
from thresher.models.adapters import Adapter
from thresher.models.checkpoint import INDEX_NAME, CheckpointWriter, canonical_layer_state
from thresher.models.device import Compute
from thresher.models.layerwise import (
    LayerwiseModel,
    keep_large_blocks_off_heap,
    release_free_memory,
)
from thresher.models.loading import load_model, model_calibration_windows
from thresher.paths import build_dir_atomically
from thresher.recipe import QUANTIZE_STAGES, CalibrationConfig, GPTQStage, QuantizeStage
from thresher.resources import measure

log = logging.getLogger(__name__)

# written anew, or provenance of the input (its manifest would make the output fail its own check)
NOT_COPIED = ("config.json", INDEX_NAME, *PROVENANCE)


@dataclass
class QuantizeReport:
    """What a quantize stage did: per-layer timings, errors, expert fallbacks."""

    method: str
    format: str
    bits: int | str  # "auto": per-matrix widths, in ``allocation``
    group_size: int
    sym: bool
    act_order: bool
    model_dir: str
    calibration_tokens: int
    wall_seconds: float = 0.0
    peak_rss_mb: float = 0.0
    artifact_mb: float = 0.0
    device: str = "cpu"
    peak_device_mb: float | None = None  # CUDA only
    offloaded_batches: int = 0  # most calibration batches held in host memory beyond the budget
    layers: list[dict] = field(default_factory=list)
    allocation: dict | None = None  # bits auto: Allocation.summary()

    def metrics(self) -> dict[str, float]:
        errors = [e for layer in self.layers for e in layer["errors"].values()]
        mixed = {}
        if self.allocation is not None:
            a = self.allocation
            mixed = {"average_bits": a["average_bits"], "quantized_mb": a["quantized_mb"],
                     **{f"weight_share_{b}bit": v for b, v in a["weight_share"].items()}}
        device = {} if self.peak_device_mb is None else {"peak_device_mb": self.peak_device_mb}
        return {**device,
            "wall_seconds": self.wall_seconds,
            "peak_rss_mb": self.peak_rss_mb,
            "artifact_mb": self.artifact_mb,
            "layers": float(len(self.layers)),
            "bits": float(mixed["average_bits"] if mixed else self.bits),
            "quantized_matrices": float(len(errors)),
            "mean_quant_error": sum(errors) / max(1, len(errors)),
            "max_quant_error": max(errors, default=0.0),
            "fallback_experts": float(sum(len(la["fallback_experts"]) for la in self.layers)),
            "calibration_tokens": float(self.calibration_tokens),
            **mixed,
        }

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "metrics": self.metrics()}, indent=2)


class ModelShapes(Protocol):
    """What ``check_stage`` reads of a model: its layers' modules (on the meta device is enough)
    and where it is; a ``LayerwiseModel`` is one, and ``thresher check`` builds one from a config."""

    path: Path
    adapter: Adapter

    @property
    def num_layers(self) -> int: ...

    def layer(self, i: int) -> nn.Module: ...


def check_stage(stage: QuantizeStage, method: QuantMethod, lw: ModelShapes) -> None:
    """Refuse options that do not fit the method, the model or the format, before any compute."""
    where = f"{lw.path}"
    foreign = sorted(stage.model_fields_set - set(type(stage).model_fields))
    if foreign:  # only a stage built without validation (model_copy) can hold them
        owners = [m for m, cls in QUANTIZE_STAGES.items() if foreign[0] in cls.model_fields]
        raise CompressionError(f"{foreign[0]} applies to method {' or '.join(owners)}, "
                               f"not {stage.method}")
    keep = set(stage.keep_16bit)
    missing = [p for p in ALWAYS_16BIT if p not in keep]
    if missing:
        raise CompressionError(
            f"{where}: keep_16bit must include {', '.join(missing)}: thresher keeps the router, "
            "the embeddings and the lm_head in 16 bits (the GPTQ/AWQ/NF4 formats and vLLM expect "
            f"them so); you may add {', '.join(OPTIONAL_16BIT)}")
    unknown = keep - set(ALWAYS_16BIT) - set(OPTIONAL_16BIT)
    if unknown:
        raise CompressionError(f"{where}: keep_16bit names unknown parts {sorted(unknown)}; "
                               f"choose from {', '.join(ALWAYS_16BIT + OPTIONAL_16BIT)}")
    fmt = format_for(method.format)
    widths = (stage.auto_widths if isinstance(stage, GPTQStage) and stage.bits == "auto"
              else [stage.uniform_bits])
    for bits in widths:
        problem = fmt.settings_problem(bits, stage.group_size)
        if problem:
            raise CompressionError(problem)
    if not fmt.integer_grid:  # NF4 blocks run over the flattened weight: any shape fits
        return
    shapes = [(t.key, *t.weight.shape) for i in range(lw.num_layers)  # meta device: shapes only
              for t in all_targets(LayerParts(lw.adapter, lw.layer(i), i, keep))]
    common = math.gcd(*(k for _, _, k in shapes))
    for key, n, k in shapes:
        for bits in widths:
            _check_shape(stage, fmt, key, n, k, bits=bits, common=common)


def _check_shape(stage: QuantizeStage, fmt: CheckpointFormat, key: str, n: int, k: int,
                 bits: int, common: int) -> None:
    gs = stage.group_size
    if gs != -1 and k % gs:
        fits = [d for d in range(8, gs, 8) if common % d == 0]  # group sizes are multiples of 8
        choice = (f"group_size {fits[-1]} divides every layer's input size, or -1 (per row)"
                  if fits else "choose -1 (one group per row)")
        raise CompressionError(f"group_size={gs} does not divide the {k} inputs of {key}; "
                               f"{choice}")
    problem = fmt.layout_problem(n, k, bits)
    if problem:
        hint = "; leave it out of candidate_bits" if stage.bits == "auto" else ""
        raise CompressionError(f"bits={bits}: {key} is [{n}, {k}], but {problem}{hint}")


def _float_modules(lw: LayerwiseModel, keep: set[str]) -> list[str]:
    """Hub-canonical names of the linear-like modules left in 16 bits."""
    names = [lw.adapter.disk_lm_head_key()]
    adapter = lw.adapter
    for i in range(lw.num_layers):
        layer = lw.layer(i)
        quantized = {t.key for t in all_targets(LayerParts(adapter, layer, i, keep))}
        if adapter.is_moe_layer(layer):
            names.append(adapter.disk_router_key(i))
            if adapter.shared_expert_gate(layer) is not None:
                names.append(adapter.disk_shared_expert_gate_key(i))
        for rel, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                (key,) = canonical_layer_state(adapter, i, {f"{rel}.weight": torch.empty(0)})
                key = key.removesuffix(".weight")
                if key not in quantized and key not in names:
                    names.append(key)
    return names


def quantize_model(model_dir: Path, stage: QuantizeStage, calibration: CalibrationConfig,
                   out_dir: Path, *, observer: LayerCallback | None = None,
                   max_shard_bytes: int = 1 << 30, show_progress: bool = True,
                   allocation: Allocation | None = None, device: str = "auto",
                   offload_budget_gb: float | None = None) -> QuantizeReport:
    """Quantize ``model_dir`` into a new checkpoint at ``out_dir`` (refused if it exists).

    ``observer`` also receives each finished layer (with dequantized weights, on the host), for
    evaluating the in-memory quantized model next to the artifact. ``allocation`` (``bits:
    auto``) gives the widths instead of measuring them (for controls such as a random
    allocation). ``device``: auto, cpu, cuda or cuda:N; ``offload_budget_gb``: calibration
    activations kept on the device (default: half its free memory on CUDA), the rest in pinned
    host memory.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise ArtifactError(f"{out_dir}: already exists; choose a new output directory")
    compute = Compute.resolve(device, offload_budget_gb)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with build_dir_atomically(out_dir) as tmp:
        with measure(compute.device) as usage:
            method, records, calibration_tokens, allocation, offloaded = _write_checkpoint(
                model_dir, stage, calibration, tmp, observer, max_shard_bytes, show_progress,
                compute, allocation)
        report = QuantizeReport(
            method=stage.method, format=method.format, bits=stage.bits,
            group_size=stage.group_size, sym=method.grid is not None and method.grid.sym,
            act_order=isinstance(stage, GPTQStage) and stage.act_order, model_dir=str(model_dir),
            calibration_tokens=calibration_tokens,
            wall_seconds=usage.wall_seconds, peak_rss_mb=usage.peak_rss_mb,
            artifact_mb=sum(f.stat().st_size for f in tmp.glob("*.safetensors")) / 2**20,
            device=compute.name, peak_device_mb=usage.peak_device_mb, offloaded_batches=offloaded,
            layers=[dataclasses.asdict(r) for r in records],
            allocation=None if allocation is None else allocation.summary(),
        )
        (tmp / QUANTIZE_REPORT).write_text(report.to_json())
    log.info("quantized %s with %s on %s in %.1f s -> %s", model_dir, stage.describe(),
             compute.name, report.wall_seconds, out_dir)
    return report


def _write_checkpoint(model_dir: Path, stage: QuantizeStage, calibration: CalibrationConfig,
                      out: Path, observer: LayerCallback | None, max_shard_bytes: int,
                      show_progress: bool, compute: Compute, allocation: Allocation | None
                      ) -> tuple[QuantMethod, list[LayerRecord], int, Allocation | None, int]:
    """Write the quantized checkpoint (weights, config, tokenizer files) into ``out``; returns
    the method, its per-layer records, the number of calibration tokens, (``bits: auto``) the
    widths chosen, and the most activation batches offloaded to the host."""
    keep_large_blocks_off_heap()
    lw = LayerwiseModel(model_dir, torch.float32, compute.device)
    method = method_for(stage)
    check_stage(stage, method, lw)
    windows = None
    if method.calibrated:
        windows = model_calibration_windows(model_dir, calibration)
        release_free_memory()  # tokenizing the corpus leaves freed pages behind
    pack = format_for(method.format).pack
    store_dtype = getattr(lw.config, "dtype", None) or torch.float32
    if isinstance(store_dtype, str):
        store_dtype = getattr(torch, store_dtype)
    skip = _float_modules(lw, set(stage.keep_16bit))
    if isinstance(stage, GPTQStage) and stage.bits == "auto":
        if allocation is None:
            allocation = measure_allocation(lw, stage, windows, store_dtype, show_progress,
                                            compute.budget_bytes)
        method = GPTQMethod(stage, allocation.widths(), allocation.base_bits,
                            allocation.dynamic())
    writer = CheckpointWriter(out, max_shard_bytes)

    def write_layer(i: int, layer: torch.nn.Module, quantized: dict) -> None:
        state = canonical_layer_state(lw.adapter, i, layer.state_dict(), per_expert=True)
        state = {k: v.to(store_dtype) if v.is_floating_point() else v for k, v in state.items()}
        for key, q in quantized.items():
            del state[f"{key}.weight"]
            state.update({f"{key}.{name}": t for name, t in pack(q).items()})
        writer.add(state)
        if observer is not None:
            observer(i, layer, quantized)

    driver = SequentialQuantizer(lw, method, stage.keep_16bit, windows, store_dtype=store_dtype,
                                 show_progress=show_progress,
                                 offload_budget_bytes=compute.budget_bytes)
    records = driver.run(write_layer)
    reader = lw.reader
    writer.add({k: reader.get(k) for k in reader.tensor_names()
                if not lw.adapter.is_disk_layer_key(k)})
    writer.close()
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != lw.config.model_type:  # a multimodal hub config: the text part
        config = lw.config.to_dict()
    config["quantization_config"] = method.quantization_config(skip)
    config.update(lw.adapter.written_config())
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in model_dir.iterdir():
        if f.is_file() and f.name not in NOT_COPIED and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    tokens = 0 if windows is None else int(windows.numel())
    return method, records, tokens, allocation, driver.offloaded


def measure_allocation(lw: LayerwiseModel, stage: GPTQStage, windows: torch.Tensor | None,
                       store_dtype: torch.dtype, show_progress: bool = False,
                       offload_budget_bytes: float | None = None) -> Allocation:
    """``bits: auto``: measure every site's damage at each candidate width (a pass of the
    sequential driver over the float model), then choose the widths under the stage's budget."""
    probe = SensitivityProbe(stage, stage.auto_widths)
    SequentialQuantizer(lw, probe, stage.keep_16bit, windows, store_dtype=store_dtype,
                        show_progress=show_progress, offload_budget_bytes=offload_budget_bytes
                        ).run(lambda i, layer, quantized: None)
    units = probe.units
    elem = torch.empty(0, dtype=store_dtype).element_size() * 8
    total = sum(math.prod(lw.reader.shape(k)) for k in lw.reader.tensor_names())
    other = (total - sum(u.weights for u in units)) * elem
    budget, target = budget_bits(units, stage, other)
    allocate(units, stage.auto_widths, stage.group_size, budget)
    result = Allocation(units, stage.group_size, budget, target)
    log.info("bits auto (%s): average %.3f bits, %.3f MiB of quantized matrices", target,
             result.average_bits, result.used_bits / 8 / 2**20)
    return result


def quantize_in_memory(model_dir: Path, stage: QuantizeStage, calibration: CalibrationConfig,
                       show_progress: bool = False, device: str = "auto",
                       offload_budget_gb: float | None = None
                       ) -> tuple[torch.nn.Module, list[LayerRecord]]:
    """The float model with every quantized weight replaced by its dequantized value.

    For comparing an artifact with the model the driver computed, and for quick in-memory
    evaluations. Holds the whole model in host memory; layers compute on ``device``.
    """
    model_dir = Path(model_dir)
    compute = Compute.resolve(device, offload_budget_gb)
    lw = LayerwiseModel(model_dir, torch.float32, compute.device)
    method = method_for(stage)
    windows = None
    if method.calibrated:
        windows = model_calibration_windows(model_dir, calibration)
    if isinstance(stage, GPTQStage) and stage.bits == "auto":
        allocation = measure_allocation(lw, stage, windows, torch.float32, show_progress,
                                        compute.budget_bytes)
        method = GPTQMethod(stage, allocation.widths(), allocation.base_bits)
    model = load_model(model_dir)
    layers = lw.adapter.layers(model)

    def copy_layer(i: int, layer: torch.nn.Module, quantized: dict) -> None:
        layers[i].load_state_dict(layer.state_dict())

    driver = SequentialQuantizer(lw, method, stage.keep_16bit, windows,
                                 show_progress=show_progress,
                                 offload_budget_bytes=compute.budget_bytes)
    records = driver.run(copy_layer)
    return model, records
