"""One variant's run, shared by the ``compress`` flow (variants in its own process) and the
``compress-variant`` flow of a fan-out (a group of variants on a worker).

It lives apart from both flows so that each imports it and neither imports the other.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger

from thresher import __version__
from thresher.evaluate.report import BASE_STAGES, DRAFTED_PREFIX, OWN_NLL, VariantRecord
from thresher.flows.stages import (
    TASK_SAMPLES_KEY,
    WINDOW_NLL_KEY,
    evaluate_artifact,
    publish_artifact,
    publish_gguf,
    run_stage,
    score_draft,
    validate_variant,
)
from thresher.formats.artifact import PRUNE_REPORT, STAGE_REPORTS, TASK_SAMPLES, WINDOW_NLL
from thresher.models.adapters import get_adapter
from thresher.models.card import runtime_note
from thresher.models.inspect import parameter_count, weight_bytes
from thresher.models.layerwise import load_config
from thresher.recipe import Recipe, Variant
from thresher.tracking import ARTIFACT_DIR_TAG, ARTIFACT_HASH_TAG, MODEL_URI_TAG, Tracker


def artifact_facts(path: str) -> dict[str, float]:
    """Size, parameter count, bits per parameter and (MoE) experts kept of a checkpoint: the
    facts every variant record and its compression ratio are built from."""
    config = load_config(path)
    size = weight_bytes(path)
    params = parameter_count(path)
    facts = {"size_bytes": float(size), "parameters": float(params),
             "bits_per_param": 8.0 * size / params}
    adapter = get_adapter(config)
    if adapter.is_moe:  # per layer after a damage-budget prune: their mean, as the prune report
        per_layer = getattr(config, "layer_num_experts", None) or [adapter.num_experts(config)]
        facts["experts_kept"] = sum(per_layer) / len(per_layer)
    return facts


def _draft_scores(recipe: Recipe, variant: Variant, artifact: str, content_hash: str,
                  base_path: str, base_hash: str, store_root: str) -> dict[str, float]:
    """The variant as a draft of the base (``validate.draft_of_base``) and the variant served
    with its own draft (``validate: {draft: NAME}``, metrics under ``DRAFTED_PREFIX``)."""
    metrics: dict[str, float] = {}
    if recipe.validate_.draft_of_base and variant.stages:
        metrics.update(score_draft(base_path, base_hash, artifact, content_hash,
                                   recipe.validate_, recipe.dtype, store_root,
                                   label=f"{variant.name}-of-base"))
    draft_name = variant.validate_.draft if variant.validate_ is not None else None
    if draft_name is not None:
        draft = next(v for v in recipe.variants if v.name == draft_name)
        path, draft_hash = base_path, base_hash
        for i, stage in enumerate(draft.stages):  # from the store when the draft ran already
            out = run_stage(path, draft_hash, stage, recipe.calibration, store_root,
                            label=f"{draft.name}/{i}-{stage.kind}", execution=recipe.execution)
            path, draft_hash = out["path"], out["content_hash"]
        metrics.update(score_draft(artifact, content_hash, path, draft_hash, recipe.validate_,
                                   recipe.dtype, store_root,
                                   label=f"{draft.name}-of-{variant.name}",
                                   prefix=DRAFTED_PREFIX))
    return metrics


def run_variant(recipe: Recipe, variant: Variant, base_path: str, base_hash: str,
                base_facts: dict[str, float], tracker: Tracker, parent: str, store_root: str,
                publish_root: Path) -> VariantRecord:
    """One variant under the parent run: its stages (from the store), evaluation, publishing,
    registration and validation, as a nested MLflow run; the record the report is built from."""
    run_id = tracker.start_run(variant.name, parent_id=parent,
                               tags={"thresher.variant": variant.name})
    status = "FAILED"
    try:
        chain = " -> ".join(s.describe() for s in variant.stages) or BASE_STAGES
        tracker.log_params(run_id, {"variant": variant.name, "stages": chain,
                                    "calibration": recipe.calibration.model_dump(mode="json")})
        if variant.validate_ is not None and variant.validate_.draft is not None:
            tracker.log_params(run_id, {"validate.draft": variant.validate_.draft})
        for i, stage in enumerate(variant.stages):
            tracker.log_params(run_id, {f"stage{i}.{stage.kind}": stage.options.model_dump(
                mode="json", exclude_none=True)})
        path, content_hash = base_path, base_hash
        metrics: dict[str, float] = {}
        lineage = []
        hits = 0
        for i, stage in enumerate(variant.stages):
            out = run_stage(path, content_hash, stage, recipe.calibration, store_root,
                            label=f"{variant.name}/{i}-{stage.kind}", execution=recipe.execution)
            hits += int(out["cache_hit"])
            metrics[f"{stage.kind}.cache_hit"] = float(out["cache_hit"])
            path, content_hash = out["path"], out["content_hash"]
            lineage.append({"stage": stage.model_dump(mode="json", exclude_none=True),
                            "store_key": out["key"], "content_hash": content_hash})
            metrics.update({f"{stage.kind}.{k}": v for k, v in out["metrics"].items()})
            for name in STAGE_REPORTS:
                if (Path(path) / name).is_file():
                    tracker.log_artifact(run_id, Path(path) / name)
        metrics["stage_cache_hits"] = float(hits)
        facts = artifact_facts(path)
        metrics.update(facts)
        metrics["compression_ratio"] = base_facts["size_bytes"] / facts["size_bytes"]
        evaluation = evaluate_artifact(path, content_hash, recipe.eval, store_root,
                                       label=variant.name)
        task_samples = evaluation.pop(TASK_SAMPLES_KEY, {})
        window_nll = {OWN_NLL: evaluation.pop(WINDOW_NLL_KEY)}
        metrics.update(evaluation)
        if task_samples:
            tracker.log_text(run_id, json.dumps(task_samples), TASK_SAMPLES)
        artifact, model_uri = path, None
        if variant.stages:
            artifact = publish_artifact(
                path, content_hash, str(publish_root), variant.name,
                {"recipe": recipe.model_dump(mode="json", by_alias=True), "variant": variant.name,
                 "lineage": {"base_model": recipe.model, "base_hash": base_hash, "stages": lineage},
                 "metrics": metrics},
            )
            tracker.set_tags(run_id, {ARTIFACT_DIR_TAG: artifact, ARTIFACT_HASH_TAG: content_hash})
            note = runtime_note(load_config(artifact))
            if note is not None:  # also the lead of the artifact's README.md
                get_run_logger().warning("variant %s: %s", variant.name, note)
            if "gguf" in recipe.publish.formats:
                gguf_cal = recipe.publish.gguf_imatrix or recipe.publish.gguf_gptq
                published = publish_gguf(
                    artifact, content_hash, str(publish_root), variant.name,
                    recipe.publish.gguf_types, recipe.calibration if gguf_cal else None,
                    recipe.eval.perplexity, str(Path(store_root) / "work"),
                    gptq=recipe.publish.gguf_gptq, variant_perplexity=metrics["perplexity"])
                for gguf_file in published["files"]:
                    tracker.log_artifact(run_id, gguf_file, artifact_path="gguf")
                metrics.update(published["metrics"])
                window_nll.update(published["window_nll"])
            if recipe.publish.registry_name:
                name = f"{recipe.publish.registry_name}-{variant.name}"
                version = tracker.register(
                    name, Path(artifact), content_hash, run_id,
                    tags={"thresher.variant": variant.name, "thresher.base_model": recipe.model,
                          "thresher.base_hash": base_hash, "thresher.stages": chain,
                          "thresher.version": __version__},
                )
                model_uri = f"models:/{name}/{version}"
                tracker.set_tags(run_id, {MODEL_URI_TAG: model_uri})
        if recipe.validate_.enabled:
            metrics.update(validate_variant(artifact, base_path, recipe.eval.perplexity,
                                            recipe.validate_, recipe.dtype, label=variant.name))
            metrics.update(_draft_scores(recipe, variant, artifact, content_hash, base_path,
                                         base_hash, store_root))
        tracker.log_metrics(run_id, metrics)
        tracker.log_text(run_id, json.dumps(window_nll), WINDOW_NLL)
        prune_report = Path(artifact) / PRUNE_REPORT
        record = VariantRecord.from_metrics(
            variant.name, metrics, {"variant": variant.name, "stages": chain},
            prune_report=json.loads(prune_report.read_text()) if prune_report.is_file() else None,
            run_id=run_id, artifact=artifact, model_uri=model_uri, task_samples=task_samples,
            window_nll=window_nll)
        status = "FINISHED"
        return record
    finally:
        tracker.end_run(run_id, status)
