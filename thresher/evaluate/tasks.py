"""Task scores through lm-evaluation-harness, returned with everything needed to trust them.

A score is only comparable to another if the task, its data and the harness are the same, so the
results carry each metric with its standard error, the lm-eval version, a hash of every task's
config (and, for the built-in tasks, of its generated data), the batch size and the backend.
They also keep every document's score (lm-eval's ``log_samples``) keyed by a hash of the document's
prompt and target, so two variants are compared pair by pair on the same documents, whatever
order or subset each was scored on (``significance.paired_documents``).

Generative tasks decode through the serving engine (``engine_lm.EngineLM``) whenever the engine
can load the model, i.e. when ``run_tasks`` gets a path or an ``engine=`` artifact; an in-memory
model with no artifact behind it generates through the reference wrapper.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thresher.errors import DataError
from thresher.evaluate.builtin_tasks import GENERATIVE, prepare_builtin_tasks
from thresher.evaluate.builtin_tasks import TASKS as BUILTIN_TASKS
from thresher.evaluate.lm_wrapper import LogitsModel, ThresherLM

if TYPE_CHECKING:
    from thresher.serve_kernels import LLM

log = logging.getLogger(__name__)

METRIC_PREFIX = "task"
# Bootstrap resampling only serves metrics that are not means; accuracy's stderr is analytic.
BOOTSTRAP_ITERS = 200


@dataclass(frozen=True)
class MetricValue:
    value: float
    stderr: float | None = None


@dataclass
class TaskResults:
    """Scores per task and metric, with the provenance a comparison needs."""

    scores: dict[str, dict[str, MetricValue]]
    samples: dict[str, int]  # documents scored per task
    task_hashes: dict[str, str]
    task_versions: dict[str, str]
    lm_eval_version: str
    batch_size: int
    backend: str
    limit: int | None = None
    wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # "<task>/<metric>" -> {document key: score}, in document-id order (``document_key``)
    per_sample: dict[str, dict[str, float]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Flat MLflow metrics: ``task/<task>/<metric>`` and ``task/<task>/<metric>_stderr``."""
        out: dict[str, float] = {}
        for task, metrics in sorted(self.scores.items()):
            for name, m in sorted(metrics.items()):
                out[f"{METRIC_PREFIX}/{task}/{name}"] = m.value
                if m.stderr is not None:
                    out[f"{METRIC_PREFIX}/{task}/{name}_stderr"] = m.stderr
        return out

    def params(self) -> dict[str, str]:
        """Flat MLflow params: the provenance of the scores."""
        out = {"tasks/lm_eval_version": self.lm_eval_version, "tasks/backend": self.backend,
               "tasks/batch_size": str(self.batch_size), "tasks/limit": str(self.limit)}
        out.update({f"tasks/{t}/config_sha256": h for t, h in sorted(self.task_hashes.items())})
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TaskResults:
        data = json.loads(text)
        data["scores"] = {t: {m: MetricValue(**v) for m, v in ms.items()}
                          for t, ms in data["scores"].items()}
        return cls(**data)


def run_tasks(model_or_path: LogitsModel | str | Path, tokenizer=None, tasks: list[str] = (),
              limit: int | None = None, batch_size: int = 16, backend: str | None = None,
              show_progress: bool = True, engine: LLM | str | Path | None = None,
              dtype: str = "float32") -> TaskResults:
    """Score a model on lm-eval tasks: thresher's built-in ones and any lm-eval task name.

    ``model_or_path`` is a loaded causal LM (anything with ``model(input_ids=...).logits``) or
    anything ``thresher.models.load_model`` accepts; a path brings its own tokenizer, and its
    generative tasks run through the serving engine. ``engine`` (an ``LLM`` or the artifact the
    loaded model came from) sends a loaded model's generation through the engine too. A path is
    loaded, and an artifact served, in ``dtype`` (float32 unless given: a task's score then
    does not depend on the CPU, as the engine's ``auto`` dtype does).
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = list(tasks)
    if not tasks:
        raise DataError("no tasks to run: name built-in tasks "
                        f"({', '.join(BUILTIN_TASKS)}) or lm-eval tasks (hellaswag, ...)")
    from thresher.evaluate.engine_lm import EngineLM  # the engine loads Triton: only when run
    from thresher.serve_kernels import LLM

    if isinstance(model_or_path, (str, Path)) and engine is None:
        from thresher.models import resolve_model

        model_or_path = engine = resolve_model(str(model_or_path))
    generative_only = all(t in GENERATIVE for t in tasks)
    if engine is not None and generative_only and isinstance(model_or_path, (str, Path)):
        model = None  # the engine does all the work: no second copy of the weights
        llm = engine if isinstance(engine, LLM) else LLM(engine, dtype=dtype)
        tokenizer = tokenizer if tokenizer is not None else llm.engine.tokenizer
    else:
        model, tokenizer = _model_and_tokenizer(model_or_path, tokenizer, dtype)
    builtin_dir = prepare_builtin_tasks()
    standard = [t for t in tasks if t not in BUILTIN_TASKS]
    # Indexing lm-eval's own task catalogue takes ~20 s on 2 cores: only when one is asked for.
    manager = TaskManager(include_path=str(builtin_dir), include_defaults=bool(standard))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise DataError(f"unknown task(s) {', '.join(unknown)}: built-in tasks are "
                        f"{', '.join(BUILTIN_TASKS)}; other names must be lm-eval tasks "
                        "(`lm_eval ls tasks`)")
    if engine is not None and any(t in GENERATIVE for t in tasks):
        lm: ThresherLM = EngineLM(llm if model is None else engine, model, tokenizer,
                                  batch_size=batch_size, backend_name=backend,
                                  show_progress=show_progress, dtype=dtype)
    else:
        lm = ThresherLM(model, tokenizer, batch_size=batch_size, backend_name=backend,
                        show_progress=show_progress)
    start = time.perf_counter()
    try:
        raw = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, task_manager=manager, limit=limit, batch_size=batch_size,
            bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True,
        )
    except (FileNotFoundError, ConnectionError, OSError) as err:
        raise DataError(f"tasks {', '.join(tasks)}: cannot load their data ({err}). Offline, "
                        "standard lm-eval tasks need their datasets in the Hugging Face cache; "
                        f"the built-in tasks ({', '.join(BUILTIN_TASKS)}) need nothing.") from err
    wall = time.perf_counter() - start
    return _collect(raw, lm, limit, wall)


def _model_and_tokenizer(model_or_path: LogitsModel | str | Path, tokenizer, dtype: str):
    if isinstance(model_or_path, (str, Path)):
        from thresher.models import load_model, load_tokenizer, resolve_model

        path = resolve_model(str(model_or_path))
        return load_model(path, dtype), tokenizer if tokenizer is not None else load_tokenizer(path)
    if tokenizer is None:
        raise DataError("run_tasks: a model object needs its tokenizer (pass tokenizer=...)")
    return model_or_path, tokenizer


def _collect(raw: dict[str, Any], lm: ThresherLM, limit: int | None, wall: float) -> TaskResults:
    """lm-eval's results dict -> TaskResults (``acc,none`` -> ``acc``; other filters suffixed)."""
    scores: dict[str, dict[str, MetricValue]] = {}
    for task, values in raw["results"].items():
        if task not in raw["configs"]:
            continue  # a group's aggregate row; its tasks are reported one by one
        metrics: dict[str, MetricValue] = {}
        for key, value in values.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filt}")
            name = metric if filt == "none" else f"{metric}_{filt}"
            metrics[name] = MetricValue(
                float(value), float(stderr) if isinstance(stderr, (int, float))
                and math.isfinite(stderr) else None)
        scores[task] = metrics
    hashes = {task: _config_hash(cfg) for task, cfg in raw["configs"].items()}
    samples = {task: int(n.get("effective", n.get("original", 0)))
               for task, n in raw.get("n-samples", {}).items()}
    return TaskResults(
        scores=scores, samples=samples, task_hashes=hashes,
        task_versions={t: str(v) for t, v in raw.get("versions", {}).items()},
        lm_eval_version=_lm_eval_version(), batch_size=lm.batch_size, backend=lm.backend_name,
        limit=limit, wall_seconds=round(wall, 2),
        per_sample=_per_sample(raw.get("samples", {}), scores),
    )


def document_key(row: dict[str, Any]) -> str:
    """A logged sample's identity: sha256 of the prompt and target hashes lm-eval logs with it,
    so a document is recognised by its text and not by its position in a run."""
    text = f"{row.get('prompt_hash')}\0{row.get('target_hash')}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _per_sample(logged: dict[str, list[dict]], scores: dict[str, dict[str, MetricValue]]
                ) -> dict[str, dict[str, float]]:
    """lm-eval's logged samples -> ``"<task>/<metric>"``: per-document scores keyed by
    ``document_key`` in doc-id order, for every metric the results report (named as in
    ``_collect``). A repeated document (same prompt and target) gets ``#2``, ``#3``: its copies
    are interchangeable, so pairing them in order is sound."""
    out: dict[str, dict[str, float]] = {}
    for task, rows in logged.items():
        seen: dict[tuple[str, str], int] = {}
        for row in sorted(rows, key=lambda r: r["doc_id"]):
            filt = row.get("filter", "none")
            key = document_key(row)
            seen[(filt, key)] = count = seen.get((filt, key), 0) + 1
            if count > 1:
                key = f"{key}#{count}"
            for metric in scores.get(task, {}):
                base = metric if filt == "none" else metric.removesuffix(f"_{filt}")
                value = row.get(base)
                if (base == metric or metric == f"{base}_{filt}") and isinstance(
                        value, (int, float, bool)):
                    out.setdefault(f"{task}/{metric}", {})[key] = float(value)
    return out


def _config_hash(config: dict[str, Any]) -> str:
    """sha256 of the task config as lm-eval ran it, plus the content of local data files."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    for name in sorted(files.values() if isinstance(files, dict) else [files]):
        path = Path(str(name))
        if path.is_file():
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")

