"""The merge stage: model directory in, complete merged Hugging Face checkpoint directory out.

``merge_model`` checks the stage against the model before any compute, observes the calibration
data layer by layer (routing frequencies, router-logit similarities and, for HC-SMoE, every
expert's mean output: ``merge_observer``), groups each MoE layer's experts (``msmoe`` or
``hcsmoe``), and writes the checkpoint one decoder layer at a time under the hub-canonical names
with one frequency-weighted merged expert per group (``merge``), the reduced expert count in
config.json, the tokenizer files and ``merge_report.json`` (every layer's groups, leaders and
routed-token counts). Like pruning, it builds the output beside its final name and renames it at
the end, and measures wall time and peak memory with ``resources.measure``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PretrainedConfig

from thresher.errors import ArtifactError, CompressionError
from thresher.formats.artifact import MERGE_REPORT
from thresher.models.adapters import get_adapter
from thresher.models.checkpoint import CheckpointWriter, canonical_layer_state, read_layer_state
from thresher.models.device import Compute
from thresher.models.layerwise import LayerwiseModel, load_config
from thresher.models.loading import model_calibration_windows
from thresher.prune.api import TOKENIZER_FILES, build_measured
from thresher.prune.hcsmoe import agglomerate, lead_by_frequency
from thresher.prune.merge import merge_layer_state
from thresher.prune.merge_observer import MergeStats, observe_for_merge
from thresher.prune.msmoe import group_around_leaders
from thresher.recipe import CalibrationConfig, MergeStage

log = logging.getLogger(__name__)


@dataclass
class LayerMergeReport:
    """One MoE layer: its groups (leader first) and every expert's routed-token count."""

    layer: int
    groups: list[list[int]]
    tokens_routed: list[int]

    @property
    def leaders(self) -> list[int]:
        return [g[0] for g in self.groups]


@dataclass
class MergeReport:
    """What a merge stage did, for MLflow (``metrics``) and the artifact (``to_json``)."""

    model_dir: str
    method: str
    ratio: float | None
    keep: int | None
    router: str
    permute: bool
    num_experts: int
    experts_kept: int
    top_k: int
    calibration_samples: int
    calibration_seq_len: int
    observe_seconds: float = 0.0
    wall_seconds: float = 0.0
    peak_rss_mb: float = 0.0
    device: str = "cpu"
    peak_device_mb: float | None = None
    layers: list[LayerMergeReport] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow."""
        routed = sum(sum(r.tokens_routed) for r in self.layers)
        folded = sum(sum(r.tokens_routed[e] for g in r.groups for e in g[1:]) for r in self.layers)
        m = {"wall_seconds": self.wall_seconds, "observe_seconds": self.observe_seconds,
             "peak_rss_mb": self.peak_rss_mb, "experts_before": float(self.num_experts),
             "experts_kept": float(self.experts_kept),
             "experts_merged_away": float(self.num_experts - self.experts_kept),
             "layers": float(len(self.layers)),
             "merged_routed_share": folded / routed if routed else 0.0}
        if self.layers:
            m["calibration_tokens"] = float(sum(self.layers[0].tokens_routed) // self.top_k)
        if self.peak_device_mb is not None:
            m["peak_device_mb"] = self.peak_device_mb
        return m

    def to_json(self) -> str:
        data = asdict(self)
        for layer, report in zip(data["layers"], self.layers, strict=True):
            layer["leaders"] = report.leaders
        data["metrics"] = self.metrics()
        return json.dumps(data, indent=2)


def experts_after_merge(num_experts: int, top_k: int, stage: MergeStage, model: str) -> int:
    """How many experts (groups) each MoE layer keeps; refuses what does not fit ``model``.
    ``keep`` may equal the expert count: every expert merged with itself, the model unchanged."""
    n = num_experts - math.floor(num_experts * stage.ratio) if stage.ratio is not None else stage.keep
    if stage.ratio is not None and n == num_experts:
        raise CompressionError(f"{model}: merge ratio {stage.ratio} of {num_experts} experts merges "
                               f"none; use a ratio of at least {1 / num_experts:.4g}")
    if n > num_experts:
        raise CompressionError(f"{model}: merge keep={n} exceeds the {num_experts} experts per "
                               "layer")
    if n < top_k:
        raise CompressionError(f"{model}: merging would leave {n} experts per layer, fewer than "
                               f"the {top_k} each token is routed to (top-k); merge less")
    return n


def check_merge(model_dir: Path, stage: MergeStage) -> tuple[PretrainedConfig, int]:
    """Refuse, before any compute, a stage that does not fit the model (unsupported family,
    dense model, amount out of range). Returns (config, experts kept per layer)."""
    config = load_config(model_dir, dequantized=True)  # MXFP4 input is written plain
    adapter = get_adapter(config)
    if not adapter.is_moe:
        raise CompressionError(f"{model_dir}: {config.model_type} is a dense model (no experts to "
                               "merge); expert merging needs a Mixture-of-Experts model")
    if getattr(config, "layer_num_experts", None):
        raise CompressionError(f"{model_dir}: its MoE layers keep different expert counts "
                               "(a damage-budget prune); merge the model it was pruned from")
    return config, experts_after_merge(adapter.num_experts(config), adapter.top_k(config), stage,
                                       str(model_dir))


def group_experts(stage: MergeStage, stats: MergeStats, n: int) -> list[list[int]]:
    """The ``n`` groups of one layer under ``stage``'s method, each with its leader first."""
    frequency = stats.frequency()
    if stage.method == "m_smoe":
        return group_around_leaders(frequency, stats.logit_similarity(), n)
    return lead_by_frequency(agglomerate(stats.mean_outputs(), n, stage.linkage), frequency)


def merge_model(model_dir: Path, stage: MergeStage, calibration: CalibrationConfig, out_dir: Path,
                *, observed: list[MergeStats] | None = None, show_progress: bool = True,
                device: str = "auto", offload_budget_gb: float | None = None) -> MergeReport:
    """Merge ``model_dir``'s experts by ``stage`` and write the checkpoint to ``out_dir``.

    ``observed`` may pass an earlier ``observe_for_merge`` of this model on this calibration
    (with mean outputs for ``hc_smoe``), so that both methods can share one observation."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise ArtifactError(f"{out_dir} already exists; choose a new output directory or remove it")
    config, n = check_merge(model_dir, stage)
    report = build_measured(
        out_dir, MERGE_REPORT, "merging", Compute.resolve(device, offload_budget_gb),
        lambda build, compute: _merge_into(build, model_dir, config, n, stage,
                                           calibration, observed, show_progress, compute))
    log.info("merged %s -> %s: %d of %d experts per layer (%s, %.1f s)", model_dir, out_dir, n,
             report.num_experts, stage.method, report.wall_seconds)
    return report


def _merge_into(build: Path, model_dir: Path, config: PretrainedConfig, n: int,
                stage: MergeStage, calibration: CalibrationConfig,
                observed: list[MergeStats] | None, show_progress: bool,
                compute: Compute) -> MergeReport:
    """Observe (unless ``observed``), group each MoE layer's experts, and write the merged
    checkpoint, config and tokenizer files into ``build``; the report lacks only the totals."""
    lw = LayerwiseModel(model_dir, device=compute.device)
    adapter = lw.adapter
    num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
    moe_layers = [i for i in range(lw.num_layers) if adapter.is_moe_layer(lw.layer(i))]
    report = MergeReport(
        model_dir=str(model_dir), method=stage.method, ratio=stage.ratio,
        keep=stage.keep, router=stage.router, permute=stage.aligns, num_experts=num_experts,
        experts_kept=n, top_k=top_k, calibration_samples=calibration.samples,
        calibration_seq_len=calibration.seq_len)
    if observed is None:
        windows = model_calibration_windows(model_dir, calibration)
        t0 = time.perf_counter()
        observed = observe_for_merge(lw, windows, stage.method == "hc_smoe", show_progress,
                                     compute.budget_bytes)
        report.observe_seconds = time.perf_counter() - t0
    stats = {s.layer: s for s in observed}
    if sorted(stats) != moe_layers or any(s.num_experts != num_experts for s in observed):
        raise CompressionError(
            f"{model_dir}: the observed statistics cover layers {sorted(stats)}, the model's MoE "
            f"layers are {moe_layers} with {num_experts} experts; observe this model again")
    groups = {i: group_experts(stage, stats[i], n) for i in moe_layers}
    for i in moe_layers:
        report.layers.append(LayerMergeReport(layer=i, groups=groups[i],
                                              tokens_routed=stats[i].count.tolist()))
        log.info("layer %d: groups %s", i, [g for g in groups[i] if len(g) > 1])

    writer = CheckpointWriter(build)
    reader = lw.reader
    writer.add((k, reader.get(k)) for k in reader.tensor_names() if not adapter.is_disk_layer_key(k))
    for i in tqdm(range(lw.num_layers), desc="write layers", unit="layer",
                  disable=not show_progress, leave=False):
        state = read_layer_state(reader, adapter, i, num_experts)
        if i in groups:
            state = merge_layer_state(adapter, i, state, groups[i], stats[i].frequency(),
                                      stage.router, stage.aligns, num_experts)
        writer.add(canonical_layer_state(adapter, i, state))
    writer.close()
    adapter.set_num_experts(config, n)
    config.update(adapter.written_config())
    config.save_pretrained(build)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, build / name)
    return report
