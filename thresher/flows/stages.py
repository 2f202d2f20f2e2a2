"""The Prefect tasks of the compress flow: resolve, stage, evaluate, publish.

Each task is a plain function of paths and configs, so the flow stays a short loop over the plan.
Stage outputs live in the content-addressed store; evaluation results are cached by the artifact's
content hash; publishing copies into place atomically and writes the manifest. A stage's metrics
(wall time and peak memory included) are the ones its own report measured, so the flow and the
CLI report the same numbers for the same work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from prefect import task

from thresher import __version__
from thresher.errors import ThresherError
from thresher.flows.store import ArtifactStore, stage_key
from thresher.formats.artifact import STORE_COMPLETE
from thresher.models.card import runtime_note, write_model_card
from thresher.models.layerwise import load_config
from thresher.models.manifest import read_manifest, write_manifest
from thresher.models.source import hash_directory, resolve_model
from thresher.paths import build_dir_atomically, write_text_atomically
from thresher.recipe import (
    CalibrationConfig,
    EvalConfig,
    ExecutionConfig,
    PerplexityConfig,
    Stage,
    ValidateConfig,
)

TASK_SAMPLES_KEY = "task_samples"  # evaluate_artifact's per-document scores, beside the metrics

log = logging.getLogger(__name__)


def _retry_unless_user_error(task, task_run, state) -> bool:
    """Retry transient failures only: a ThresherError (bad option, bad input) fails the same way."""
    try:
        state.result()
    except ThresherError:
        return False
    except Exception:
        return True
    return False


@task(name="resolve-model", retries=2, retry_delay_seconds=5)
def resolve_base(model: str) -> tuple[str, str]:
    """A local snapshot of the base model and its content hash."""
    path = resolve_model(model)
    return str(path), hash_directory(path)


def execute_stage(input_dir: Path, stage: Stage, calibration: CalibrationConfig, out_dir: Path,
                  execution: ExecutionConfig | None = None):
    """Run one stage's algorithm (no caching, no tracking): the unit the store caches, computed
    on ``execution.device``."""
    execution = execution or ExecutionConfig()
    compute = {"device": execution.device, "offload_budget_gb": execution.offload_budget_gb}
    if stage.prune is not None:
        from thresher.prune.api import prune_model

        return prune_model(input_dir, stage.prune, calibration, out_dir, **compute)
    if stage.merge is not None:
        from thresher.prune.merge_api import merge_model

        return merge_model(input_dir, stage.merge, calibration, out_dir, **compute)
    from thresher.compress.api import quantize_model

    return quantize_model(input_dir, stage.quantize, calibration, out_dir, **compute)


@task(name="stage", retries=1, retry_delay_seconds=5, retry_condition_fn=_retry_unless_user_error,
      task_run_name="{label}")
def run_stage(input_dir: str, input_hash: str, stage: Stage, calibration: CalibrationConfig,
              store_root: str, label: str, execution: ExecutionConfig | None = None
              ) -> dict[str, Any]:
    """The store entry for ``stage`` on the input artifact, computing it only when missing.

    ``execution`` (the device) is not part of the key: any device computes the same artifact up
    to floating-point order, so a store entry made on the CPU serves a GPU run and back."""
    store = ArtifactStore(store_root)
    key = stage_key(input_hash, stage, calibration)
    with store.locked(key) as entry:
        if entry.complete:
            record = entry.record()
            log.info("%s: found in the store (%s), not recomputed", label, key[:12])
            return {"path": str(entry.path), "content_hash": record["content_hash"], "key": key,
                    "cache_hit": True, "metrics": record.get("metrics", {})}
        out = store.scratch_dir(key)
        log.info("%s: computing (store key %s)", label, key[:12])
        metrics = execute_stage(Path(input_dir), stage, calibration, out, execution).metrics()
        entry = store.commit(key, out, {"stage": stage.model_dump(mode="json", exclude_none=True),
                                        "input_hash": input_hash, "metrics": metrics})
    return {"path": str(entry.path), "content_hash": entry.content_hash, "key": key,
            "cache_hit": False, "metrics": metrics}


@task(name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=_retry_unless_user_error,
      task_run_name="evaluate-{label}")
def evaluate_artifact(path: str, content_hash: str, eval_cfg: EvalConfig, store_root: str,
                      label: str) -> dict[str, Any]:
    """Perplexity (and tasks, when the recipe lists them) of an artifact, cached by content hash.

    Flat metrics, plus the per-document task scores under ``TASK_SAMPLES_KEY``."""
    blob = json.dumps({"artifact": content_hash, "eval": eval_cfg.model_dump(mode="json"),
                       "thresher": __version__}, sort_keys=True)
    cache = Path(store_root) / "evals" / f"{hashlib.sha256(blob.encode()).hexdigest()}.json"
    if cache.is_file():
        log.info("%s: evaluation found in the store, not recomputed", label)
        return json.loads(cache.read_text())
    from thresher.evaluate.perplexity import heldout_perplexity
    from thresher.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(path)
    model = load_model(path)  # loaded once: perplexity and tasks both run on it
    start = time.perf_counter()
    ppl = heldout_perplexity(model, eval_cfg.perplexity, tokenizer=tokenizer)
    metrics = {"perplexity": ppl.perplexity, "nll": ppl.nll, "eval_tokens": float(ppl.tokens),
               "eval_seconds": time.perf_counter() - start}
    if eval_cfg.tasks:
        from thresher.evaluate.tasks import run_tasks

        results = run_tasks(model, tokenizer, eval_cfg.tasks, limit=eval_cfg.task_limit,
                            engine=path)  # generative tasks decode through the serving engine
        metrics.update(results.metrics())
        metrics[TASK_SAMPLES_KEY] = results.per_sample  # popped by the flow, not an MLflow metric
    write_text_atomically(cache, json.dumps(metrics))
    return metrics


@task(name="publish", retries=2, retry_delay_seconds=5, task_run_name="publish-{variant}")
def publish_artifact(path: str, content_hash: str, dest_root: str, variant: str,
                     manifest_fields: dict[str, Any]) -> str:
    """Copy the artifact to ``dest_root/variant`` atomically, with its ``thresher.json`` manifest
    and, when standard runtimes cannot load it (per-layer expert counts), a README.md that says
    so."""
    dest = Path(dest_root) / variant
    existing = read_manifest(dest) if dest.is_dir() else None
    if existing and existing.get("content_hash") == content_hash:
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with build_dir_atomically(dest) as building:
        shutil.copytree(path, building, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(STORE_COMPLETE))
        note = runtime_note(load_config(path))
        if note is not None:
            write_model_card(building, variant, note)
        write_manifest(building, content_hash=content_hash, **manifest_fields)
    return str(dest)


@task(name="publish-gguf", retries=1, retry_delay_seconds=5,
      retry_condition_fn=_retry_unless_user_error, task_run_name="publish-gguf-{variant}")
def publish_gguf(artifact: str, content_hash: str, dest_root: str, variant: str,
                 types: list[str], calibration: CalibrationConfig | None,
                 gptq: bool = False) -> list[str]:
    """GGUF files of a published variant in ``dest_root/variant.gguf/`` (one per type, with an
    importance matrix from ``calibration`` when given, and blocks rounded by GPTQ against its
    Hessians with ``gptq``); rebuilt only when the artifact or ``gptq`` changed.
    A GPTQ/AWQ artifact is handed to q4_1 as it is, or skipped with a warning if its groups are
    not Q4_1's 32."""
    from thresher.errors import ExportError
    from thresher.export import compute_importance, export_gguf
    from thresher.formats.config import packed_format

    dest = Path(dest_root) / f"{variant}.gguf"
    stamp = dest / "source.json"
    source = {"content_hash": content_hash, **({"gptq": True} if gptq else {})}
    if stamp.is_file() and json.loads(stamp.read_text()) == source:
        return sorted(str(p) for p in dest.glob("*.gguf"))
    packed = packed_format(load_config(artifact), artifact) is not None
    types = ["q4_1"] if packed else types
    importance = (compute_importance(artifact, calibration, show_progress=False, hessians=gptq)
                  if calibration is not None and not packed else None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with build_dir_atomically(dest) as building:
        for gguf_type in types:
            try:
                export_gguf(artifact, building / f"{variant}-{gguf_type}.gguf", gguf_type,
                            importance=importance, gptq=gptq and importance is not None,
                            show_progress=False)
            except ExportError as err:
                if not packed:
                    raise
                log.warning("%s: no GGUF file: %s", variant, err)
        (building / "source.json").write_text(json.dumps(source))
    return sorted(str(p) for p in dest.glob("*.gguf"))


@task(name="validate", retries=1, retry_delay_seconds=5, retry_condition_fn=_retry_unless_user_error,
      task_run_name="validate-{label}")
def validate_variant(path: str, base_path: str, perplexity_cfg: PerplexityConfig,
                     validate_cfg: ValidateConfig, dtype: str, label: str) -> dict[str, float]:
    """The validation run in the serving engine: perplexity, agreement with the base, load test."""
    from thresher.serve_kernels.validate import validate_artifact

    return validate_artifact(path, base_path, perplexity_cfg, validate_cfg, dtype=dtype)
