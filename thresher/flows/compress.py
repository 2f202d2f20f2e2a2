"""The ``compress`` flow: a recipe's variants, stage by stage, evaluated, published and compared.

The flow body is a short loop over the recipe's variants. Stage results come from the
content-addressed store (computed once per distinct prefix, resumed after a crash), MLflow gets a
parent run for the flow and a nested run per variant, and the comparison table closes the run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.context import get_run_context

from thresher import __version__
from thresher.flows.stages import (
    evaluate_artifact,
    publish_artifact,
    resolve_base,
    run_stage,
    validate_variant,
)
from thresher.flows.tracking import Tracker, git_sha
from thresher.models.adapters import get_adapter
from thresher.models.inspect import parameter_count, weight_bytes
from thresher.models.layerwise import load_config
from thresher.paths import state_dir
from thresher.recipe import Recipe, Variant, load_recipe

log = logging.getLogger(__name__)

REPORT_FILES = ("prune_report.json", "quantize_report.json")


def _artifact_facts(path: str) -> dict[str, float]:
    config = load_config(path)
    size = weight_bytes(path)
    params = parameter_count(path)
    facts = {"size_bytes": float(size), "parameters": float(params),
             "bits_per_param": 8.0 * size / params}
    adapter = get_adapter(config)
    if adapter.is_moe:
        facts["experts_kept"] = float(adapter.num_experts(config))
    return facts


def _flow_run_name() -> str:
    try:
        return str(get_run_context().flow_run.name)
    except Exception:
        return time.strftime("%Y%m%d-%H%M%S")


def run_recipe(recipe: Recipe, tracking_uri: str | None = None, store_dir: str | None = None,
               publish_dir: str | None = None) -> dict[str, Any]:
    """The flow body (shared by the ``compress`` and ``compress-file`` flows)."""
    logger = get_run_logger()
    # Fail before any compute if tracking is unusable.
    tracker = Tracker(tracking_uri or recipe.tracking.mlflow_uri, recipe.tracking.experiment or recipe.name)
    store_root = str(Path(store_dir) if store_dir else state_dir() / "store")
    publish_root = Path(publish_dir or recipe.publish.dir or state_dir() / "published") / recipe.name

    base_path, base_hash = resolve_base(recipe.model)
    parent = tracker.start_run(
        _flow_run_name(), system_metrics=True,
        tags={"thresher.base_model": recipe.model, "thresher.base_hash": base_hash,
              "thresher.recipe": recipe.name, "thresher.git_sha": git_sha() or "unknown"},
    )
    status = "FAILED"
    try:
        tracker.log_params(parent, recipe.model_dump(mode="json", by_alias=True))
        tracker.log_text(parent, yaml.safe_dump(recipe.model_dump(mode="json", by_alias=True),
                                                sort_keys=False), "recipe.yaml")
        base_facts = _artifact_facts(base_path)
        rows = []
        for variant in recipe.variants:
            rows.append(_run_variant(recipe, variant, base_path, base_hash, base_facts, tracker,
                                     parent, store_root, publish_root))
            logger.info("variant %s: perplexity %.3f", variant.name, rows[-1]["perplexity"])
        summary = {"parent_run_id": parent, "tracking_uri": tracker.uri,
                   "experiment_id": tracker.experiment_id, "variants": rows}
        tracker.log_text(parent, comparison_markdown(rows), "comparison.md")
        summary["report_dir"] = str(_log_report(rows, tracker, parent, store_root))
        status = "FINISHED"
        return summary
    finally:
        tracker.end_run(parent, status)


def _run_variant(recipe: Recipe, variant: Variant, base_path: str, base_hash: str,
                 base_facts: dict[str, float], tracker: Tracker, parent: str, store_root: str,
                 publish_root: Path) -> dict[str, Any]:
    run_id = tracker.start_run(variant.name, parent_id=parent,
                               tags={"thresher.variant": variant.name})
    status = "FAILED"
    try:
        chain = " -> ".join(s.describe() for s in variant.stages) or "base"
        tracker.log_params(run_id, {"variant": variant.name, "stages": chain,
                                    "calibration": recipe.calibration.model_dump(mode="json")})
        for i, stage in enumerate(variant.stages):
            tracker.log_params(run_id, {f"stage{i}.{stage.kind}": stage.options.model_dump(
                mode="json", exclude_none=True)})
        path, content_hash = base_path, base_hash
        metrics: dict[str, float] = {}
        lineage = []
        hits = 0
        for i, stage in enumerate(variant.stages):
            out = run_stage(path, content_hash, stage, recipe.calibration, store_root,
                            label=f"{variant.name}/{i}-{stage.kind}")
            hits += int(out["cache_hit"])
            path, content_hash = out["path"], out["content_hash"]
            lineage.append({"stage": stage.model_dump(mode="json", exclude_none=True),
                            "store_key": out["key"], "content_hash": content_hash})
            metrics.update({f"{stage.kind}.{k}": v for k, v in out["metrics"].items()})
            for name in REPORT_FILES:
                if (Path(path) / name).is_file():
                    tracker.log_artifact(run_id, Path(path) / name)
        metrics["stage_cache_hits"] = float(hits)
        facts = _artifact_facts(path)
        metrics.update(facts)
        metrics["compression_ratio"] = base_facts["size_bytes"] / facts["size_bytes"]
        metrics.update(evaluate_artifact(path, content_hash, recipe.eval, store_root,
                                         label=variant.name))
        row: dict[str, Any] = {"variant": variant.name, "stages": chain, "run_id": run_id,
                               "artifact": path, **metrics}
        if variant.stages:
            published = publish_artifact(
                path, content_hash, str(publish_root), variant.name,
                {"recipe": recipe.model_dump(mode="json", by_alias=True), "variant": variant.name,
                 "lineage": {"base_model": recipe.model, "base_hash": base_hash, "stages": lineage},
                 "metrics": metrics},
            )
            row["artifact"] = published
            tracker.set_tags(run_id, {"thresher.artifact_dir": published,
                                      "thresher.artifact_hash": content_hash})
            if recipe.publish.registry_name:
                name = f"{recipe.publish.registry_name}-{variant.name}"
                version = tracker.register(
                    name, Path(published), content_hash, run_id,
                    tags={"thresher.variant": variant.name, "thresher.base_model": recipe.model,
                          "thresher.base_hash": base_hash, "thresher.stages": chain,
                          "thresher.version": __version__},
                )
                row["model_uri"] = f"models:/{name}/{version}"
                tracker.set_tags(run_id, {"thresher.model_uri": row["model_uri"]})
        if recipe.validate_.enabled:
            validation = validate_variant(row["artifact"], base_path, recipe.eval.perplexity,
                                          recipe.validate_, recipe.dtype, label=variant.name)
            metrics.update(validation)
            row.update(validation)
        tracker.log_metrics(run_id, metrics)
        status = "FINISHED"
        return row
    finally:
        tracker.end_run(run_id, status)


def _log_report(rows: list[dict[str, Any]], tracker: Tracker, parent: str, store_root: str
                ) -> Path:
    """The comparison dashboards (table, Pareto plot, task bars, saliency heatmap) on the parent run."""
    from thresher.evaluate.report import VariantRecord, build_report, log_report

    records = []
    for row in rows:
        metrics = {k: v for k, v in row.items() if isinstance(v, int | float)}
        prune_report = Path(row["artifact"]) / "prune_report.json"
        records.append(VariantRecord.from_metrics(
            row["variant"], metrics, {"variant": row["variant"], "stages": row["stages"]},
            prune_report=json.loads(prune_report.read_text()) if prune_report.is_file() else None,
            run_id=row["run_id"]))
    out = Path(store_root) / "reports" / parent
    report = build_report(records, out)
    log_report(report, parent, tracking_uri=tracker.uri)
    return out


def validation_columns(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The validation run's columns of the comparison table (none when validation was off).

    Agreement with the base, engine throughput at the highest load-test concurrency and TTFT
    at the lowest, one cell per row.
    """
    levels = sorted({int(k.removeprefix("validate/throughput_c").removesuffix("_tok_s"))
                     for r in rows for k in r if k.startswith("validate/throughput_c")})
    if not levels:
        return {}
    hi, lo = levels[-1], levels[0]

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    return {
        "agreement": [cell(r, "validate/agreement", ".3f") for r in rows],
        f"tok/s @c{hi}": [cell(r, f"validate/throughput_c{hi}_tok_s", ".1f") for r in rows],
        f"TTFT p50 ms @c{lo}": [cell(r, f"validate/ttft_p50_ms_c{lo}", ".0f") for r in rows],
    }


def comparison_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of a flow run's comparison table (the markdown log and the console)."""
    base_ppl = next((r["perplexity"] for r in rows if r["stages"] == "base"), None)
    extra = validation_columns(rows)
    header = ["variant", "stages", "size (MB)", "bits/param", "experts", "perplexity", "vs base",
              *extra]
    cells = []
    for i, r in enumerate(rows):
        delta = f"{100 * (r['perplexity'] / base_ppl - 1):+.2f}%" if base_ppl else "-"
        experts = f"{int(r['experts_kept'])}" if "experts_kept" in r else "-"
        cells.append([r["variant"], r["stages"], f"{r['size_bytes'] / 1e6:.2f}",
                      f"{r['bits_per_param']:.2f}", experts, f"{r['perplexity']:.3f}", delta,
                      *(column[i] for column in extra.values())])
    return header, cells


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison table of a flow run, as markdown."""
    header, cells = comparison_table(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


@flow(name="compress", persist_result=False, log_prints=True)
def compress(recipe: Recipe, tracking_uri: str | None = None, store_dir: str | None = None,
             publish_dir: str | None = None) -> dict[str, Any]:
    """Compress a model as the recipe says: stages, evaluation, publishing, comparison."""
    return run_recipe(recipe, tracking_uri, store_dir, publish_dir)


@flow(name="compress-file", persist_result=False, log_prints=True)
def compress_file(recipe_path: str, tracking_uri: str | None = None, store_dir: str | None = None,
                  publish_dir: str | None = None) -> dict[str, Any]:
    """Like ``compress``, reading the recipe from a YAML file (what deployments and schedules use)."""
    return run_recipe(load_recipe(recipe_path), tracking_uri, store_dir, publish_dir)
