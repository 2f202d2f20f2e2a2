"""Fan-out: a recipe's variants as Prefect flow runs on a work pool, one run per shared prefix.

The parent (``run_recipe`` with a work pool) groups the variants by their first stage, so a group
is a maximal shared prefix and its children (reap50, reap50-gptq4, reap50-awq4), and submits one
``compress-variant`` flow run per group with ``run_deployment(..., timeout=0)``. Workers on any
machine pull those runs. The parent polls them, resubmits a run that ends FAILED or CRASHED (up to
``execution.retries``), and rebuilds the records from the nested MLflow runs, whichever machine
logged them.

Why ``run_deployment`` on a process work pool rather than a Dask or Ray task runner: workers are
separate machines that pull work, with nothing else to run; a lost machine is a flow run that the
Prefect server turns CRASHED (heartbeats and the zombie automation below), which the parent sees
and resubmits; and the retry resumes from the last finished stage, because the store's per-key
lock and atomic commit keep every finished stage. A task runner would need its own cluster
(scheduler, workers, their failure handling) beside the Prefect server.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.deployments.runner import EntrypointType

from thresher.errors import ExecutionError
from thresher.evaluate.report import VariantRecord, record_from_run
from thresher.flows.stages import resolve_base
from thresher.flows.variant import artifact_facts, run_variant
from thresher.recipe import Recipe
from thresher.tracking import Tracker

log = logging.getLogger(__name__)

FLOW_NAME = "compress-variant"
CRASH_AUTOMATION = "thresher: crash flow runs without heartbeats"
FLOW_RUN_TAG = "thresher.prefect_flow_run"  # on a variant's MLflow run: which flow run made it
HOST_TAG = "thresher.host"
VARIANT_TAG = "thresher-variant"  # on every compress-variant flow run; the automation keys on it
HEARTBEAT_SECONDS = 30  # Prefect's minimum
HEARTBEAT_GRACE_SECONDS = 90  # no heartbeat for this long: the run's machine is gone


def variant_groups(recipe: Recipe) -> list[list[str]]:
    """Variant names grouped by their first stage (the base variants form one group)."""
    groups: dict[str, list[str]] = {}
    for v in recipe.variants:
        first = v.stages[0].model_dump_json(exclude_none=True) if v.stages else ""
        groups.setdefault(first, []).append(v.name)
    return list(groups.values())


def deployment_name(pool: str) -> str:
    return f"{FLOW_NAME}/{pool}"


def deploy_variant_flow(pool: str) -> str:
    """Register (or update) ``compress-variant/<pool>``. Its entrypoint is the module path
    ``thresher.flows.fanout.compress_variant``: workers import it from the thresher installed
    where they run (the same version everywhere), with no source checkout to copy or mount."""
    deployment_id = compress_variant.deploy(
        name=pool, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH,
        tags=["thresher", VARIANT_TAG], print_next_steps=False,
        description="thresher: a group of a recipe's variants, under the sweep's MLflow run",
        job_variables={"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS)}},
        ignore_warnings=True,
    )
    ensure_crash_automation()
    return str(deployment_id)


def ensure_crash_automation(grace_s: int = HEARTBEAT_GRACE_SECONDS) -> None:
    """Prefect's zombie-flow automation, created once: a ``compress-variant`` flow run whose
    heartbeats stop (its worker died) is set CRASHED, so the parent can resubmit it. It matches
    only runs tagged ``VARIANT_TAG``: other flow runs beat every 180 s (Prefect's default)."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    with get_client(sync_client=True) as client:
        if client.read_automations_by_name(CRASH_AUTOMATION):
            return
    Automation(
        name=CRASH_AUTOMATION,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                    "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                    "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.id": f"prefect.tag.{VARIANT_TAG}"}),
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=grace_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {grace_s} s: the worker is gone")],
    ).create()


def fan_out(recipe: Recipe, pool: str, parent: str, tracker: Tracker, store_root: str,
            publish_root: Path, parent_name: str) -> list[VariantRecord]:
    """Run the variant groups on ``pool``'s workers; the records, read back from MLflow."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise ExecutionError(
                f"work pool {pool!r}: not found at the Prefect API {client.api_url}; set "
                "PREFECT_API_URL to the server the workers poll and create the pool (`prefect "
                f"work-pool create {pool} --type process`), or start `thresher stack up`"
            ) from None
        try:
            client.read_deployment_by_name(deployment_name(pool))
        except ObjectNotFound:
            deploy_variant_flow(pool)
    ensure_crash_automation()
    groups = variant_groups(recipe)
    params = {"recipe": recipe.model_dump(mode="json", by_alias=True), "parent_run_id": parent,
              "tracking_uri": tracker.uri, "store_dir": store_root,
              "publish_dir": str(publish_root)}

    def submit(i: int) -> UUID:
        run = run_deployment(deployment_name(pool), parameters={**params, "variants": groups[i]},
                             flow_run_name=f"{parent_name}-{groups[i][0]}", timeout=0,
                             tags=["thresher", VARIANT_TAG, f"group-{i}"])
        logger.info("group %d (%s): flow run %s", i, ", ".join(groups[i]), run.name)
        return run.id

    runs = {i: submit(i) for i in range(len(groups))}
    tries = dict.fromkeys(runs, 0)
    while runs:
        time.sleep(recipe.execution.poll_seconds)
        with get_client(sync_client=True) as client:
            states = {i: client.read_flow_run(run_id).state for i, run_id in runs.items()}
        for i, state in states.items():
            if state is None or not state.is_final():
                continue
            if state.is_completed():
                del runs[i]
            elif tries[i] < recipe.execution.retries:
                tries[i] += 1
                logger.warning("group %d ended %s (%s); resubmitting (%d of %d)", i, state.type.value,
                               state.message, tries[i], recipe.execution.retries)
                runs[i] = submit(i)
            else:
                raise ExecutionError(
                    f"variants {', '.join(groups[i])}: the flow run ended {state.type.value} "
                    f"({state.message}) after {tries[i]} resubmissions (execution.retries); see "
                    "the Prefect UI for its logs")
    return records_from_parent(tracker, parent, [v.name for v in recipe.variants])


def records_from_parent(tracker: Tracker, parent: str, names: list[str]) -> list[VariantRecord]:
    """The finished nested runs under ``parent``, in the recipe's order."""
    runs = {r.info.run_name: r for r in tracker.variant_runs(parent)
            if r.info.status == "FINISHED" and r.info.run_id != parent}
    missing = [n for n in names if n not in runs]
    if missing:
        raise ExecutionError(f"variants {', '.join(missing)}: no finished MLflow run under the "
                             f"parent run {parent} at {tracker.uri}")
    return [record_from_run(tracker, runs[n]) for n in names]


def _finished_or_cleared(tracker: Tracker, parent: str, name: str) -> bool:
    """True when ``name`` already finished under ``parent`` (an earlier try of this group); a
    run of it left RUNNING by a lost worker is marked KILLED, so only the retry's run counts."""
    done = False
    for run in tracker.variant_runs(parent):
        if run.info.run_name != name or run.info.run_id == parent:
            continue
        if run.info.status == "FINISHED":
            done = True
        elif run.info.status == "RUNNING":
            tracker.end_run(run.info.run_id, "KILLED")
    return done


@flow(name=FLOW_NAME, persist_result=False, log_prints=True)
def compress_variant(recipe: Recipe, variants: list[str], parent_run_id: str, tracking_uri: str,
                     store_dir: str, publish_dir: str) -> list[dict[str, Any]]:
    """Run the named variants of ``recipe`` as nested MLflow runs under ``parent_run_id``."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    tracker = Tracker(tracking_uri, experiment=recipe.tracking.experiment or recipe.name)
    base_path, base_hash = resolve_base(recipe.model)
    base_facts = artifact_facts(base_path)
    by_name = {v.name: v for v in recipe.variants}
    unknown = [n for n in variants if n not in by_name]
    if unknown:
        raise ExecutionError(f"variants {', '.join(unknown)}: not in recipe {recipe.name!r}")
    out = []
    for name in variants:
        if _finished_or_cleared(tracker, parent_run_id, name):
            logger.info("variant %s: finished by an earlier try, not rerun", name)
            continue
        record = run_variant(recipe, by_name[name], base_path, base_hash, base_facts, tracker,
                             parent_run_id, store_dir, Path(publish_dir))
        tracker.set_tags(record.run_id, {FLOW_RUN_TAG: str(flow_run.id),
                                         HOST_TAG: socket.gethostname()})
        logger.info("variant %s: perplexity %.3f", name, record.perplexity)
        out.append(record.to_dict())
    return out
