"""The ``compress`` flow: a recipe's variants, stage by stage, evaluated, published and compared.

The flow body is a short loop over the recipe's variants. Stage results come from the
content-addressed store (computed once per distinct prefix, resumed after a crash), MLflow gets a
parent run for the flow and a nested run per variant, and each variant becomes a
``VariantRecord``; the comparison report built from those records closes the run.

The Prefect flow run and the MLflow parent run share one name, the recipe's name and the start
time (``demo-20261122-183012``), and the parent run is tagged with the recipe's name and hash, so
a run is found by what it ran.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.context import get_run_context

from thresher.evaluate.report import (
    BASE_STAGES,
    OWN_NLL,
    VariantRecord,
    build_report,
    log_report,
)
from thresher.flows.fanout import fan_out
from thresher.flows.pareto import alias_pareto_front
from thresher.flows.stages import TASK_SAMPLES_KEY, WINDOW_NLL_KEY, evaluate_artifact, resolve_base
from thresher.flows.summary import publish_summary
from thresher.flows.sweep import expand_sweep, parse_recipe
from thresher.flows.variant import artifact_facts, run_variant
from thresher.formats.artifact import TASK_SAMPLES, WINDOW_NLL
from thresher.paths import state_dir
from thresher.recipe import Recipe
from thresher.tracking import REFERENCE_TAG, Tracker, git_sha

log = logging.getLogger(__name__)


def recipe_hash(recipe: Recipe) -> str:
    """Short sha256 of the recipe's canonical JSON: equal recipes, equal hashes."""
    canonical = json.dumps(recipe.model_dump(mode="json", by_alias=True), sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def run_name(recipe_name: str) -> str:
    """A run's name: the recipe's name and the start time, e.g. ``demo-20261122-183012``."""
    return f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _compress_run_name() -> str:
    from prefect.runtime import flow_run

    recipe = flow_run.parameters["recipe"]  # a Recipe in process, a dict from the API
    name = recipe.name if isinstance(recipe, Recipe) else (
        recipe.get("name") if isinstance(recipe, dict) else None)
    return run_name(name if isinstance(name, str) and name else "compress")


def _parent_run_name(recipe: Recipe) -> str:
    """The Prefect flow run's name, so the MLflow parent run and the flow run match."""
    try:
        return str(get_run_context().flow_run.name)
    except Exception:  # called outside a flow run
        return run_name(recipe.name)


def run_recipe(recipe: Recipe, tracking_uri: str | None = None, store_dir: str | None = None,
               publish_dir: str | None = None, work_pool: str | None = None) -> dict[str, Any]:
    """The flow body: the variants, the comparison report, the flow run's summary. With a work
    pool (argument or ``execution.work_pool``) the variants run on its workers (``fanout``)."""
    from thresher.flows.preflight import preflight

    logger = get_run_logger()
    preflight(recipe)  # what `thresher check` refuses fails here too, before any compute
    # Fail before any compute if tracking is unusable.
    tracker = Tracker(tracking_uri or recipe.tracking.mlflow_uri,
                      experiment=recipe.tracking.experiment or recipe.name)
    store_root = str(Path(store_dir) if store_dir else state_dir() / "store")
    publish_root = Path(publish_dir or recipe.publish.dir or state_dir() / "published") / recipe.name

    base_path, base_hash = resolve_base(recipe.model)
    parent_name = _parent_run_name(recipe)
    parent = tracker.start_run(
        parent_name, system_metrics=True,
        tags={"thresher.base_model": recipe.model, "thresher.base_hash": base_hash,
              "thresher.recipe": recipe.name, "thresher.recipe_hash": recipe_hash(recipe),
              "thresher.git_sha": git_sha() or "unknown"},
    )
    status = "FAILED"
    try:
        tracker.log_params(parent, recipe.model_dump(mode="json", by_alias=True))
        tracker.log_text(parent, yaml.safe_dump(recipe.model_dump(mode="json", by_alias=True),
                                                sort_keys=False), "recipe.yaml")
        base_facts = artifact_facts(base_path)
        records = []
        pool = work_pool or recipe.execution.work_pool
        if pool:
            records = fan_out(recipe, pool, parent, tracker, store_root, publish_root, parent_name)
        else:
            for variant in recipe.variants:
                records.append(run_variant(recipe, variant, base_path, base_hash, base_facts,
                                           tracker, parent, store_root, publish_root))
                logger.info("variant %s: perplexity %.3f", variant.name, records[-1].perplexity)
        if not any(v.stages == [] for v in recipe.variants):
            records.insert(0, _reference_record(recipe, base_path, base_hash, base_facts, tracker,
                                                parent, store_root,
                                                {v.name for v in recipe.variants}))
            logger.info("reference (base model): perplexity %.3f", records[0].perplexity)
        report = build_report(records, Path(store_root) / "reports" / parent)
        if recipe.publish.registry_name:
            alias_pareto_front(tracker, records)
        log_report(report, parent, tracking_uri=tracker.uri)
        publish_summary(report, parent_name, recipe.name, tracker.uri, str(tracker.experiment_id),
                        parent)
        status = "FINISHED"
        return {"parent_run_id": parent, "tracking_uri": tracker.uri,
                "experiment_id": tracker.experiment_id, "report_dir": str(report.out_dir),
                "variants": [r.to_dict() for r in records]}
    finally:
        tracker.end_run(parent, status)


def _reference_record(recipe: Recipe, base_path: str, base_hash: str,
                      base_facts: dict[str, float], tracker: Tracker, parent: str,
                      store_root: str, taken: set[str]) -> VariantRecord:
    """The base model evaluated as every variant is (cached by its content hash like any
    evaluation), for a recipe that lists no base variant: the reference row every difference is
    taken from. Nothing is published or served for it."""
    name = next(n for n in ("base", "base-reference", f"base-{base_hash[:8]}") if n not in taken)
    run_id = tracker.start_run(name, parent_id=parent,
                               tags={"thresher.variant": name, REFERENCE_TAG: "true"})
    status = "FAILED"
    try:
        tracker.log_params(run_id, {"variant": name, "stages": BASE_STAGES})
        evaluation = evaluate_artifact(base_path, base_hash, recipe.eval, store_root, label=name)
        task_samples = evaluation.pop(TASK_SAMPLES_KEY, {})
        window_nll = {OWN_NLL: evaluation.pop(WINDOW_NLL_KEY)}
        metrics = {**base_facts, "compression_ratio": 1.0, **evaluation}
        tracker.log_metrics(run_id, metrics)
        tracker.log_text(run_id, json.dumps(window_nll), WINDOW_NLL)
        if task_samples:
            tracker.log_text(run_id, json.dumps(task_samples), TASK_SAMPLES)
        status = "FINISHED"
        return VariantRecord.from_metrics(name, metrics, {"variant": name, "stages": BASE_STAGES},
                                          run_id=run_id, artifact=base_path,
                                          task_samples=task_samples, window_nll=window_nll)
    finally:
        tracker.end_run(run_id, status)


@flow(name="compress", flow_run_name=_compress_run_name, persist_result=False,
      log_prints=True, validate_parameters=False)
def compress(recipe: Recipe, tracking_uri: str | None = None, store_dir: str | None = None,
             publish_dir: str | None = None, work_pool: str | None = None) -> dict[str, Any]:
    """Compress a model as the recipe says: stages, evaluation, publishing, comparison.

    Prefect draws the run form of a deployment from this signature; the recipe is checked by
    ``parse_recipe`` (the checks of ``thresher check``, then the sweep's expansion), not by
    Prefect's own validation.

    Args:
        recipe: the compression job (a recipe YAML's content): model, data, variants
        tracking_uri: MLflow tracking URI (default: the recipe's, else $MLFLOW_TRACKING_URI)
        store_dir: artifact store of stage outputs (default: under $THRESHER_HOME)
        publish_dir: where variants are published (default: the recipe's publish.dir)
        work_pool: Prefect work pool whose workers run the variants (default: the recipe's
            execution.work_pool; none: every variant runs in this flow run)
    """
    if isinstance(recipe, Recipe):
        recipe = expand_sweep(recipe, where="flow parameter 'recipe'")
    else:  # a run started from the API or the UI's form
        recipe = parse_recipe(recipe, where="flow parameter 'recipe'")
    return run_recipe(recipe, tracking_uri, store_dir, publish_dir, work_pool)
