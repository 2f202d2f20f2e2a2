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
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import task

from thresher import __version__
from thresher.errors import ArtifactError, ModelError, ThresherError
from thresher.flows.store import ArtifactStore, stage_key
from thresher.formats.artifact import GGUF_SOURCE, MANIFEST, STORE_COMPLETE
from thresher.models.card import runtime_note, write_gguf_card, write_model_card
from thresher.models.layerwise import load_config
from thresher.models.manifest import read_manifest, verify_artifact, write_manifest
from thresher.models.source import hash_directory, resolve_model
from thresher.paths import build_dir_atomically, storage_error, write_text_atomically
from thresher.recipe import (
    CalibrationConfig,
    EvalConfig,
    ExecutionConfig,
    PerplexityConfig,
    Stage,
    ValidateConfig,
)

TASK_SAMPLES_KEY = "task_samples"  # evaluate_artifact's per-document scores, beside the metrics
WINDOW_NLL_KEY = "window_nll"  # evaluate_artifact's per-window NLLs, beside the metrics

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
            damage = entry.damage()
            if damage is None:
                record = entry.record()
                log.info("%s: found in the store (%s), not recomputed", label, key[:12])
                return {"path": str(entry.path), "content_hash": record["content_hash"],
                        "key": key, "cache_hit": True, "metrics": record.get("metrics", {})}
            log.warning("%s: store entry %s is damaged (%s); computing it again", label,
                        entry.path, damage)
            store.discard(key)
        out = store.scratch_dir(key)
        log.info("%s: computing (store key %s)", label, key[:12])
        try:
            metrics = execute_stage(Path(input_dir), stage, calibration, out, execution).metrics()
            entry = store.commit(key, out, {"stage": stage.model_dump(mode="json",
                                                                      exclude_none=True),
                                            "input_hash": input_hash, "metrics": metrics})
        except OSError as err:  # a full disk while writing the stage's output
            raise storage_error(err, entry.path) from err
        finally:
            shutil.rmtree(out.parent, ignore_errors=True)  # the scratch folder, whatever happened
    return {"path": str(entry.path), "content_hash": entry.content_hash, "key": key,
            "cache_hit": False, "metrics": metrics}


@task(name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=_retry_unless_user_error,
      task_run_name="evaluate-{label}")
def evaluate_artifact(path: str, content_hash: str, eval_cfg: EvalConfig, store_root: str,
                      label: str) -> dict[str, Any]:
    """Perplexity (and tasks, when the recipe lists them) of an artifact, cached by content hash.

    Flat metrics, plus the per-document task scores under ``TASK_SAMPLES_KEY`` and the
    per-window NLLs (what a change from the base is paired on) under ``WINDOW_NLL_KEY``."""
    blob = json.dumps({"artifact": content_hash, "eval": eval_cfg.model_dump(mode="json"),
                       "thresher": __version__}, sort_keys=True)
    cache = Path(store_root) / "evals" / f"{hashlib.sha256(blob.encode()).hexdigest()}.json"
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if WINDOW_NLL_KEY in cached:  # older entries lack the windows: measured again
            log.info("%s: evaluation found in the store, not recomputed", label)
            return cached
    from thresher.data.windows import eval_windows
    from thresher.evaluate.perplexity import window_nlls
    from thresher.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(path)
    try:
        model = load_model(path)  # loaded once: perplexity and tasks both run on it
    except ModelError as err:  # named by the variant: the store's directories are hashes
        raise ModelError(f"evaluating {label}: {err}") from None
    start = time.perf_counter()
    cfg = eval_cfg.perplexity
    windows = eval_windows(tokenizer, cfg)
    nlls = window_nlls(model, windows, batch_size=cfg.batch_size, show_progress=False)
    nll = float(nlls.mean())
    metrics = {"perplexity": math.exp(nll), "nll": nll,
               "eval_tokens": float(windows.shape[0] * (windows.shape[1] - 1)),
               "eval_seconds": time.perf_counter() - start, WINDOW_NLL_KEY: nlls.tolist()}
    if eval_cfg.tasks:
        from thresher.evaluate.tasks import run_tasks

        results = run_tasks(model, tokenizer, eval_cfg.tasks, limit=eval_cfg.task_limit,
                            engine=path)  # generative tasks decode through the serving engine
        metrics.update(results.metrics())
        metrics[TASK_SAMPLES_KEY] = results.per_sample  # popped by the flow, not an MLflow metric
    write_text_atomically(cache, json.dumps(metrics))
    return metrics


def _refuse_foreign(dest: Path, recipe: str, variant: str) -> None:
    """Raise unless ``dest`` is a publish of ``recipe``'s ``variant`` (its thresher.json says so):
    publishing replaces its own earlier output and nothing else."""
    try:
        manifest = read_manifest(dest) if dest.is_dir() else None
    except ArtifactError:
        manifest = None
    mine = (isinstance(manifest, dict) and manifest.get("variant") == variant
            and isinstance(manifest.get("recipe"), dict) and manifest["recipe"].get("name") == recipe)
    if not mine:
        raise ArtifactError(f"{dest}: exists and is not a thresher publish of recipe {recipe!r}, "
                            f"variant {variant!r} (no matching {MANIFEST}); refusing to replace "
                            "it. Move it away or choose another publish.dir")


@task(name="publish", retries=2, retry_delay_seconds=5, retry_condition_fn=_retry_unless_user_error,
      task_run_name="publish-{variant}")
def publish_artifact(path: str, content_hash: str, dest_root: str, variant: str,
                     manifest_fields: dict[str, Any]) -> str:
    """Copy the artifact to ``dest_root/variant`` atomically, with its ``thresher.json`` manifest
    and, when standard runtimes cannot load it (per-layer expert counts), a README.md that says
    so.

    The copy is re-hashed against ``content_hash`` before it is published (a store entry damaged
    since its stage ran is refused), and fsynced before the rename. An existing ``dest`` is
    replaced only when it is an earlier publish of the same recipe and variant.
    """
    dest = Path(dest_root) / variant
    recipe = str(manifest_fields["recipe"]["name"])
    if dest.exists():
        _refuse_foreign(dest, recipe, variant)
        existing = read_manifest(dest)
        if existing.get("content_hash") == content_hash:
            try:
                verify_artifact(dest)
                return str(dest)
            except ArtifactError as err:
                log.warning("%s: republishing it: %s", dest, err)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with build_dir_atomically(dest, lambda d: _refuse_foreign(d, recipe, variant)) as building:
        shutil.copytree(path, building, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(STORE_COMPLETE))
        copied = hash_directory(building)
        if copied != content_hash:
            raise ArtifactError(f"{path}: its files no longer match the content hash recorded "
                                f"when it was computed ({content_hash[:12]}, now {copied[:12]}); "
                                "not published. Run the flow again to recompute it")
        note = runtime_note(load_config(path))
        if note is not None:
            write_model_card(building, variant, note)
        write_manifest(building, content_hash=content_hash, **manifest_fields)
    return str(dest)


def _refuse_foreign_gguf(dest: Path) -> None:
    """Raise unless ``dest`` holds thresher's GGUF stamp (``GGUF_SOURCE``)."""
    try:
        stamp = json.loads((dest / GGUF_SOURCE).read_text())
    except (OSError, ValueError):
        stamp = None
    source = stamp.get("source", stamp) if isinstance(stamp, dict) else None
    if not (isinstance(source, dict) and "content_hash" in source):
        raise ArtifactError(f"{dest}: exists and is not thresher's GGUF output (no source.json); "
                            "refusing to replace it. Move it away or choose another publish.dir")


@task(name="publish-gguf", retries=1, retry_delay_seconds=5,
      retry_condition_fn=_retry_unless_user_error, task_run_name="publish-gguf-{variant}")
def publish_gguf(artifact: str, content_hash: str, dest_root: str, variant: str,
                 types: list[str], calibration: CalibrationConfig | None,
                 perplexity: PerplexityConfig, work_root: str, gptq: bool = False,
                 variant_perplexity: float | None = None) -> dict[str, Any]:
    """One GGUF file per asked type in ``dest_root/variant.gguf/``, with a README.md that says
    how each was made; rebuilt only when the artifact or the options changed.

    A type that the variant's codes already are (4-bit GPTQ/AWQ in groups of 32 -> q4_1) is handed
    over as it is; any other type is rounded from the variant's weights (dequantized first when
    the variant is quantized: a second rounding), with an importance matrix from
    ``calibration`` when given and GPTQ rounding with ``gptq``. The weights of every file that was
    rounded are dequantized from the file and evaluated on the ``perplexity`` windows, so the
    comparison shows what llama.cpp runs. Returns ``{"files", "metrics", "window_nll"}``
    (metrics ``gguf/<type>/<measure>``)."""
    from thresher.export import (
        HANDOFF,
        REQUANTIZED,
        compute_importance,
        dequantize_gguf,
        export_gguf,
        gguf_route,
    )
    from thresher.formats.config import packed_format
    from thresher.models.quantized import write_dequantized

    dest = Path(dest_root) / f"{variant}.gguf"
    stamp = dest / GGUF_SOURCE
    source = {"content_hash": content_hash, "types": list(types), "gptq": gptq,
              "calibration": calibration.model_dump(mode="json") if calibration else None,
              "perplexity": perplexity.model_dump(mode="json")}
    if stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if recorded.get("source") == source:
            return recorded["result"]
    config = load_config(artifact, dequantized=True)  # MXFP4 base: exported dequantized
    fmt = packed_format(config, artifact)
    qc = getattr(config, "quantization_config", None) or {}
    in_order = not (qc if isinstance(qc, dict) else qc.to_dict()).get("desc_act", False)
    routes = {t: gguf_route(fmt, t, in_order) for t in types}
    result: dict[str, Any] = {"files": [], "metrics": {}, "window_nll": {}}
    described = []
    Path(work_root).mkdir(parents=True, exist_ok=True)
    if dest.exists():
        _refuse_foreign_gguf(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_root, prefix="gguf-") as work, \
            build_dir_atomically(dest, _refuse_foreign_gguf) as building:
        plain = Path(artifact)
        if REQUANTIZED in routes.values():
            plain = write_dequantized(artifact, Path(work) / "dequantized")
        importance = None
        if calibration is not None and set(routes.values()) != {HANDOFF}:
            importance = compute_importance(plain, calibration, show_progress=False,
                                            hessians=gptq)
        for gguf_type, how in routes.items():
            name = f"{variant}-{gguf_type}.gguf"
            key = f"gguf/{gguf_type}"
            entry: dict[str, Any] = {"file": name, "type": gguf_type, "how": how}
            if how == HANDOFF:
                export_gguf(artifact, building / name, "q4_1", show_progress=False)
            else:
                export_gguf(plain, building / name, gguf_type, importance=importance,
                            gptq=gptq and importance is not None, show_progress=False)
                weights = dequantize_gguf(building / name, plain, Path(work) / gguf_type)
                nlls = heldout_window_nlls(weights, perplexity)
                shutil.rmtree(weights)
                entry.update(perplexity=math.exp(sum(nlls) / len(nlls)),
                             imatrix=importance is not None)
                result["window_nll"][key] = nlls
                result["metrics"].update({f"{key}/perplexity": entry["perplexity"],
                                          f"{key}/requantized": float(how == REQUANTIZED)})
                log.info("%s: %s (%s), perplexity %.3f", variant, name, how,
                         entry["perplexity"])
            result["metrics"][f"{key}/size_bytes"] = float((building / name).stat().st_size)
            described.append(entry)
        write_gguf_card(building, variant, described, variant_perplexity)
        result["files"] = [str(dest / e["file"]) for e in described]
        (building / GGUF_SOURCE).write_text(json.dumps({"source": source, "files": described,
                                                        "result": result}))
    return result


def heldout_window_nlls(path: str | Path, cfg: PerplexityConfig) -> list[float]:
    """Mean NLL per held-out window of the checkpoint at ``path`` (the windows ``cfg`` names)."""
    from thresher.data.windows import eval_windows
    from thresher.evaluate.perplexity import window_nlls
    from thresher.models import load_model, load_tokenizer

    windows = eval_windows(load_tokenizer(path), cfg)
    return window_nlls(load_model(path), windows, batch_size=cfg.batch_size,
                       show_progress=False).tolist()


@task(name="validate", retries=1, retry_delay_seconds=5, retry_condition_fn=_retry_unless_user_error,
      task_run_name="validate-{label}")
def validate_variant(path: str, base_path: str, perplexity_cfg: PerplexityConfig,
                     validate_cfg: ValidateConfig, dtype: str, label: str) -> dict[str, float]:
    """The validation run in the serving engine: perplexity, agreement with the base, load test."""
    from thresher.serve_kernels.validate import validate_artifact

    try:
        return validate_artifact(path, base_path, perplexity_cfg, validate_cfg, dtype=dtype)
    except ModelError as err:
        raise ModelError(f"validating {label}: {err}") from None


@task(name="score-draft", retries=1, retry_delay_seconds=5,
      retry_condition_fn=_retry_unless_user_error, task_run_name="score-draft-{label}")
def score_draft(target: str, target_hash: str, draft: str, draft_hash: str,
                validate_cfg: ValidateConfig, dtype: str, store_root: str, label: str,
                prefix: str = "validate/") -> dict[str, float]:
    """``draft`` as the speculative-decoding draft of ``target``, greedy over the validation
    prompts: ``<prefix>draft_acceptance_rate``, ``draft_mean_accepted_length``,
    ``speculative_tokens_per_s`` and ``speculative_speedup`` (over the target's plain decoding,
    measured beside it). Cached by both content hashes, like an evaluation, so a rerun after a
    crash does not serve the pair again."""
    blob = json.dumps({"target": target_hash, "draft": draft_hash, "dtype": dtype,
                       "k": validate_cfg.num_speculative_tokens,
                       "max_tokens": validate_cfg.max_tokens, "thresher": __version__},
                      sort_keys=True)
    cache = Path(store_root) / "drafts" / f"{hashlib.sha256(blob.encode()).hexdigest()}.json"
    if cache.is_file():
        log.info("%s: draft score found in the store, not recomputed", label)
        measured = json.loads(cache.read_text())
    else:
        from thresher.serve_kernels.draft_score import draft_acceptance, plain_tokens_per_second

        k, max_tokens = validate_cfg.num_speculative_tokens, validate_cfg.max_tokens
        score = draft_acceptance(target, draft, num_speculative_tokens=k, max_tokens=max_tokens,
                                 dtype=dtype)
        plain = plain_tokens_per_second(target, max_tokens=max_tokens, dtype=dtype)
        measured = {**score.metrics(prefix=""),
                    "speculative_speedup": score.tokens_per_second / plain}
        write_text_atomically(cache, json.dumps(measured))
    return {f"{prefix}{k}": float(v) for k, v in measured.items()}
