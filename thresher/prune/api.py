"""The prune stage: model directory in, complete pruned Hugging Face checkpoint directory out.

``prune_model`` checks every option against the model before any compute, observes the
calibration data layer by layer (unless the method is the ``random`` control), chooses the experts
each MoE layer keeps (``plan``: criterion or ``auto``, uniform or damage budget, protected super
experts), and writes the pruned checkpoint one decoder layer at a time under the
hub-canonical names, with the tokenizer files and ``prune_report.json`` (every expert's saliency,
routed-token counts, the removed experts of each layer and, where measured, the local errors or
end-to-end loss increases of every candidate, the one chosen, and a damage budget's table). The output is built in a hidden
sibling directory and renamed at the end (``paths.build_dir_atomically``), so a crash never leaves
a partial artifact behind; wall time and peak memory come from ``resources.measure``, the number
the flows report too. ``device`` says where the observation computes (``models.device``): an
execution setting, the statistics agreeing up to floating-point order on any device.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from thresher.errors import ArtifactError, CompressionError
from thresher.formats.artifact import PRUNE_REPORT
from thresher.models.adapters import MEMORY_DOWN, Adapter, get_adapter
from thresher.models.checkpoint import (
    CheckpointReader,
    CheckpointWriter,
    canonical_layer_state,
    read_layer_state,
)
from thresher.models.device import ActivationStore, Compute
from thresher.models.layerwise import LayerwiseModel, load_config
from thresher.models.loading import model_calibration_windows
from thresher.paths import build_dir_atomically
from thresher.prune.endtoend import loss_of
from thresher.prune.mask import choose_experts, experts_to_keep, prune_layer_state
from thresher.prune.observer import ExpertStats, Observation, observe_experts, observe_layers
from thresher.prune.plan import LayerChoice, needs_probes, plan_layers
from thresher.prune.refit import RefitResult, refit_down
from thresher.prune.saliency import OBSERVED_METHODS, random_saliency, saliency
from thresher.recipe import CalibrationConfig, PruneStage
from thresher.resources import measure

log = logging.getLogger(__name__)
R = TypeVar("R")  # a stage report with wall_seconds, peak_rss_mb, device, peak_device_mb, to_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


@dataclass
class LayerPruneReport:
    """One MoE layer: every expert's saliency and routed-token count, and what was removed."""

    layer: int
    saliency: list[float]
    tokens_routed: list[int] | None  # None for the random control, which observes nothing
    kept: list[int]
    removed: list[int]
    criterion: str = ""  # whose expert set was kept (``auto``: the candidate with least error)
    protected: list[int] = field(default_factory=list)  # super experts never removed
    local_error: float | None = None  # held-out local reconstruction error of the kept set
    errors: dict[str, float] = field(default_factory=dict)  # every candidate's (stage's damage)
    loss_increase: float | None = None  # damage 'loss': held-out loss increase of the kept set
    damage: list[float] = field(default_factory=list)  # damage budget: per removal count 0..bound
    refit_error_before: float | None = None  # refit: routed-output residual / ||y||^2, original
    refit_error_after: float | None = None  # ... with the refit down projections

    @property
    def dead_experts(self) -> list[int]:
        return [] if self.tokens_routed is None else [
            e for e, n in enumerate(self.tokens_routed) if n == 0]


@dataclass
class PruneReport:
    """What a prune stage did, for MLflow (``metrics``) and the artifact (``to_json``)."""

    model_dir: str
    method: str
    ratio: float | None
    keep: int | None
    seed: int
    num_experts: int
    experts_kept: int  # per layer; with a damage budget the mean over the MoE layers
    top_k: int
    calibration_samples: int
    calibration_seq_len: int
    observe_seconds: float = 0.0
    wall_seconds: float = 0.0
    peak_rss_mb: float = 0.0
    device: str = "cpu"
    peak_device_mb: float | None = None  # CUDA only
    budget: str = "uniform"
    damage: str = "local"  # what auto and a damage budget minimize: local error or loss increase
    heldout_windows: int = 0  # calibration windows held out from saliency for local errors
    refit: bool = False  # kept experts' down projections refit to the unpruned block's output
    loss_windows: int = 0  # damage 'loss': held-out windows the loss increases are measured on
    layers: list[LayerPruneReport] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow."""
        m = {
            "wall_seconds": self.wall_seconds,
            "observe_seconds": self.observe_seconds,
            "peak_rss_mb": self.peak_rss_mb,
            "experts_before": float(self.num_experts),
            "experts_kept": float(self.experts_kept),
            "experts_removed": float(self.num_experts - self.experts_kept),
            "layers": float(len(self.layers)),
        }
        if self.peak_device_mb is not None:
            m["peak_device_mb"] = self.peak_device_mb
        observed = [r for r in self.layers if r.tokens_routed is not None]
        if observed:
            routed = sum(sum(r.tokens_routed) for r in observed)
            removed = sum(sum(r.tokens_routed[e] for e in r.removed) for r in observed)
            m["calibration_tokens"] = float(sum(observed[0].tokens_routed) // self.top_k)
            m["dead_experts"] = float(sum(len(r.dead_experts) for r in observed))
            m["removed_routed_share"] = removed / routed if routed else 0.0
        measured = [r.local_error for r in self.layers if r.local_error is not None]
        if measured:
            m["local_error_sum"] = sum(measured)
        losses = [r.loss_increase for r in self.layers if r.loss_increase is not None]
        if losses:
            m["loss_increase_sum"] = sum(losses)
        refit = [r for r in self.layers if r.refit_error_before is not None]
        if refit:
            before = sum(r.refit_error_before for r in refit)
            m["refit_error_left"] = (sum(r.refit_error_after for r in refit) / before
                                     if before > 0 else 1.0)
        return m

    def to_json(self) -> str:
        data = asdict(self)
        for layer, report in zip(data["layers"], self.layers, strict=True):
            layer["dead_experts"] = report.dead_experts
        data["metrics"] = self.metrics()
        return json.dumps(data, indent=2)


def check_prune(model_dir: Path, stage: PruneStage) -> tuple[PretrainedConfig, int]:
    """Refuse, before any compute, a stage that does not fit the model: unsupported family, dense
    model, ratio or keep out of range, fewer experts left than top-k. Returns (config, kept)."""
    # UnsupportedArchitectureError for families without adapter; MXFP4 input is written plain
    config = load_config(model_dir, dequantized=True)
    adapter = get_adapter(config)
    if not adapter.is_moe:
        raise CompressionError(
            f"{model_dir}: {config.model_type} is a dense model (no experts to prune); "
            "expert pruning needs a Mixture-of-Experts model")
    n_keep = experts_to_keep(adapter.num_experts(config), adapter.top_k(config), stage.ratio,
                             stage.keep, str(model_dir))
    return config, n_keep


def prune_model(model_dir: Path, stage: PruneStage, calibration: CalibrationConfig,
                out_dir: Path, *, observed: list[ExpertStats] | Observation | None = None,
                show_progress: bool = True, device: str = "auto",
                offload_budget_gb: float | None = None) -> PruneReport:
    """Prune ``model_dir`` by ``stage`` and write the pruned checkpoint to ``out_dir``.

    ``observed`` may pass statistics of this model on this calibration from an earlier
    ``observe_experts`` call (or, for ``auto`` and damage budgets, an ``observe_layers`` call with
    held-out windows: ``observe_for``), so that several methods can be compared on one observation.
    ``device`` (auto, cpu, cuda, cuda:N) and ``offload_budget_gb`` (calibration activations kept
    on the device; default: half its free memory on CUDA) say where the observation runs.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise ArtifactError(f"{out_dir} already exists; choose a new output directory or remove it")
    config, n_keep = check_prune(model_dir, stage)
    report = build_measured(
        out_dir, PRUNE_REPORT, "pruning", Compute.resolve(device, offload_budget_gb),
        lambda build, compute: _prune_into(build, model_dir, config, n_keep, stage,
                                           calibration, observed, show_progress, compute))
    log.info("pruned %s -> %s: %d of %d experts kept in %d layers (%.1f s)", model_dir, out_dir,
             n_keep, report.num_experts, len(report.layers), report.wall_seconds)
    return report


def build_measured(out_dir: Path, report_file: str, doing: str, compute: Compute,
                   build: Callable[[Path, Compute], R]) -> R:
    """Run a stage's ``build`` into a directory that replaces ``out_dir`` only when it succeeds,
    and write the report it returns, completed with time and memory, beside the checkpoint as
    ``report_file``; pruning and merging share it. ``doing`` names the stage in the error raised
    when ``out_dir`` appears meanwhile."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with build_dir_atomically(out_dir) as build_dir:
        with measure(compute.device) as usage:
            report = build(build_dir, compute)
        report.wall_seconds, report.peak_rss_mb = usage.wall_seconds, usage.peak_rss_mb
        report.device, report.peak_device_mb = compute.name, usage.peak_device_mb
        (build_dir / report_file).write_text(report.to_json())
        if out_dir.exists():
            raise ArtifactError(f"{out_dir} appeared while {doing}; refusing to overwrite it")
    return report


def _prune_into(build: Path, model_dir: Path, config: PretrainedConfig, n_keep: int,
                stage: PruneStage, calibration: CalibrationConfig,
                observed: list[ExpertStats] | None, show_progress: bool,
                compute: Compute) -> PruneReport:
    """Score and choose the experts, then write the pruned checkpoint, config and tokenizer files
    into ``build``; the report it returns lacks only wall time and peak memory."""
    lw = LayerwiseModel(model_dir, device=compute.device)
    adapter = lw.adapter
    num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
    moe_layers = [i for i in range(lw.num_layers) if adapter.is_moe_layer(lw.layer(i))]
    report = PruneReport(
        model_dir=str(model_dir), method=stage.method, ratio=stage.ratio,
        keep=stage.keep, seed=stage.seed, num_experts=num_experts, experts_kept=n_keep,
        top_k=top_k, calibration_samples=calibration.samples,
        calibration_seq_len=calibration.seq_len, budget=stage.budget, damage=stage.damage,
        refit=stage.refit)
    windows: torch.Tensor | None = None

    if stage.method == "random":
        gen = torch.Generator().manual_seed(stage.seed)
        scores = {i: random_saliency(num_experts, gen) for i in moe_layers}
        plan = {i: LayerChoice(kept=choose_experts(scores[i], n_keep), criterion="random")
                for i in moe_layers}
        stats: dict[int, ExpertStats] = {}
    else:
        if observed is None:
            windows = model_calibration_windows(model_dir, calibration)
            t0 = time.perf_counter()
            observed = observe_for(stage, lw, windows, show_progress, compute.budget_bytes)
            report.observe_seconds = time.perf_counter() - t0
        observed_stats = observed.stats if isinstance(observed, Observation) else observed
        stats = {s.layer: s for s in observed_stats}
        if sorted(stats) != moe_layers or any(s.num_experts != num_experts for s in observed_stats):
            raise CompressionError(
                f"{model_dir}: the observed statistics cover layers {sorted(stats)}, the model's "
                f"MoE layers are {moe_layers} with {num_experts} experts; observe this model again")
        if isinstance(observed, Observation) and observed.heldout:
            report.heldout_windows = observed.heldout_windows
        end_to_end = None
        if stage.damage == "loss" and isinstance(observed, Observation) and observed.heldout:
            loss_windows = _loss_windows(observed, stage.loss_tokens)
            report.loss_windows = len(loss_windows)
            end_to_end = loss_of(lw, loss_windows, show_progress=show_progress)
        plan = plan_layers(stage, observed, lw.num_layers, num_experts, top_k, n_keep,
                           str(model_dir), end_to_end)
        shown = stage.method if stage.method in OBSERVED_METHODS else "reap"  # auto: REAP's
        scores = {i: saliency(shown, stats[i]) for i in moe_layers}

    kept: dict[int, list[int]] = {}
    for i in moe_layers:
        choice = plan[i]
        kept[i] = choice.kept
        report.layers.append(LayerPruneReport(
            layer=i, saliency=scores[i].tolist(),
            tokens_routed=stats[i].count.tolist() if i in stats else None,
            kept=kept[i], removed=[e for e in range(num_experts) if e not in kept[i]],
            criterion=choice.criterion, protected=choice.protected,
            local_error=choice.local_error, errors=choice.errors,
            loss_increase=choice.loss_increase, damage=choice.damage))
        log.info("layer %d: removing experts %s (%s)", i, report.layers[-1].removed,
                 choice.criterion)

    counts = {len(k) for k in kept.values()}
    if len(counts) > 1:  # a damage budget: per-layer expert counts in config.json
        config.layer_num_experts = [len(kept.get(i, [])) or max(counts)
                                    for i in range(lw.num_layers)]
        n_keep = max(counts)
    adapter.set_num_experts(config, n_keep)
    if stage.refit:
        if windows is None:
            windows = model_calibration_windows(model_dir, calibration)
        results = _write_refit_checkpoint(lw, kept, windows, stage, build, show_progress,
                                          compute.budget_bytes)
        for layer_report in report.layers:
            result = results[layer_report.layer]
            layer_report.refit_error_before = result.error_before
            layer_report.refit_error_after = result.error_after
    else:
        _write_checkpoint(lw.reader, adapter, lw.num_layers, num_experts, kept, build,
                          show_progress)
    config.update(adapter.written_config())
    config.save_pretrained(build)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, build / name)
    return report


def observe_for(stage: PruneStage, lw: LayerwiseModel, windows: torch.Tensor,
                show_progress: bool = True, offload_budget_bytes: float | None = None
                ) -> Observation:
    """The observation ``stage`` needs: saliency statistics on all ``windows``, or, for ``auto``
    and damage budgets, on all but the last ``heldout_fraction`` of them, with probes."""
    if not needs_probes(stage):
        return Observation(stats=observe_experts(lw, windows, show_progress=show_progress,
                                                 offload_budget_bytes=offload_budget_bytes),
                           search={}, heldout={})
    held = max(1, round(len(windows) * stage.heldout_fraction))
    if held >= len(windows):
        raise CompressionError(
            f"{len(windows)} calibration windows leave none for saliency after holding out "
            f"{held} (heldout_fraction {stage.heldout_fraction}); use more samples")
    return observe_layers(lw, windows[:-held], windows[-held:], stage.probe_tokens,
                          show_progress=show_progress, offload_budget_bytes=offload_budget_bytes)


def _loss_windows(observed: Observation, loss_tokens: int) -> torch.Tensor:
    """The held-out windows damage 'loss' runs: whole windows up to ``loss_tokens``, at least one."""
    if observed.heldout_ids is None:
        raise CompressionError("damage 'loss' needs the held-out windows; observe with observe_for")
    ids = observed.heldout_ids
    return ids[:max(1, loss_tokens // ids.shape[1])]


def _write_checkpoint(reader: CheckpointReader, adapter: Adapter, num_layers: int, num_experts: int,
                      kept: dict[int, list[int]], out: Path, show_progress: bool) -> None:
    """Copy the non-layer tensors, then each decoder layer with its mask applied."""
    writer = CheckpointWriter(out)
    writer.add((k, reader.get(k)) for k in reader.tensor_names() if not adapter.is_disk_layer_key(k))
    for i in tqdm(range(num_layers), desc="write layers", unit="layer", disable=not show_progress,
                  leave=False):
        state = read_layer_state(reader, adapter, i, num_experts)
        if i in kept:
            state = prune_layer_state(adapter, i, state, kept[i], num_experts)
        writer.add(canonical_layer_state(adapter, i, state))
    writer.close()


@torch.no_grad()
def _write_refit_checkpoint(lw: LayerwiseModel, kept: dict[int, list[int]], windows: torch.Tensor,
                            stage: PruneStage, out: Path, show_progress: bool,
                            budget_bytes: float, batch_size: int = 8) -> dict[int, RefitResult]:
    """``_write_checkpoint`` with each MoE layer's kept down projections refit (``refit``).

    The calibration ``windows`` walk the model one decoder layer at a time through the layers as
    pruned and refit so far (GPTQ's sequential order): each MoE layer is fit on the inputs the
    pruned model gives it, to the unpruned layer's routed output on those inputs
    (``refit_target: block``), or to that plus what the layer must add for its output to match
    the unpruned model's at that depth (``model``: the unpruned stream is walked beside it)."""
    adapter, config, reader = lw.adapter, lw.config, lw.reader
    num_experts = adapter.num_experts(config)
    writer = CheckpointWriter(out)
    writer.add((k, reader.get(k)) for k in reader.tensor_names() if not adapter.is_disk_layer_key(k))
    lw.load_outer()
    hidden = ActivationStore(lw.device, budget_bytes)
    unpruned = ActivationStore(lw.device, budget_bytes) if stage.refit_target == "model" else None
    for batch in windows.split(batch_size):
        hidden.append(lw.embed(batch))
        if unpruned is not None:
            unpruned.append(lw.embed(batch))
    results: dict[int, RefitResult] = {}
    for i in tqdm(range(lw.num_layers), desc="refit layers", unit="layer",
                  disable=not show_progress, leave=False):
        layer = lw.load_layer(i)
        state = read_layer_state(reader, adapter, i, num_experts)  # the dtype on disk
        if i in kept:
            inputs, offset = _moe_inputs(lw, i, hidden, unpruned, stage.refit_tokens)
            results[i] = refit_down(adapter, layer, config, inputs, kept[i], stage.refit_damp,
                                    offset=offset)
        if unpruned is not None:
            for b in range(len(unpruned)):
                unpruned[b] = lw.layer_forward(i, unpruned[b])
        if i in kept:
            state = prune_layer_state(adapter, i, state, kept[i], num_experts)
            for pos, e in enumerate(kept[i]):
                down = adapter.down_to_fused(results[i].down[e])
                state[MEMORY_DOWN][pos] = down.to(state[MEMORY_DOWN].dtype).cpu()
            adapter.resize_experts(layer, len(kept[i]))
            layer.load_state_dict({k: v.to(lw.device, lw.dtype) if v.is_floating_point()
                                   else v.to(lw.device) for k, v in state.items()},
                                  strict=True, assign=True)
        for b in range(len(hidden)):
            hidden[b] = lw.layer_forward(i, hidden[b])
        lw.release_layer(i)
        writer.add(canonical_layer_state(adapter, i, state))
    writer.close()
    return results


def _moe_inputs(lw: LayerwiseModel, i: int, hidden: ActivationStore,
                unpruned: ActivationStore | None, max_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``max_tokens`` inputs [T, H] of unpruned layer ``i``'s MoE block on ``hidden``
    and, with the ``unpruned`` stream, the layer's output there minus its output on ``hidden``
    (what the block must add to put the pruned stream back on the unpruned one)."""
    taken: list[torch.Tensor] = []
    offsets: list[torch.Tensor] = []
    count = 0

    def capture(_module: torch.nn.Module, args: tuple) -> None:
        taken.append(args[0].reshape(-1, args[0].shape[-1])[:max_tokens - count])

    for b in range(len(hidden)):
        if count >= max_tokens:
            break
        handle = lw.adapter.mlp(lw.layer(i)).register_forward_pre_hook(capture)
        try:
            out = lw.layer_forward(i, hidden[b])
        finally:
            handle.remove()
        n = taken[-1].shape[0]
        if unpruned is not None:
            target = lw.layer_forward(i, unpruned[b])
            offsets.append((target - out).reshape(-1, out.shape[-1])[:n].float())
        count += n
    return torch.cat(taken), torch.cat(offsets) if offsets else None
