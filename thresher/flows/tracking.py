"""MLflow tracking: one parent run per flow run, one nested run per variant, the model registry.

Every call names its run id explicitly (``MlflowClient``), never MLflow's active run: Prefect runs
tasks on worker threads and MLflow's active run is thread-local. The tracking URI follows MLflow's
convention: an explicit URI (recipe or CLI), else ``$MLFLOW_TRACKING_URI``, else the embedded
default, a SQLite file under thresher's state directory. Reachability is checked before any
compute, so a wrong URI fails in a second, not after hours of calibration.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from thresher import __version__
from thresher.errors import TrackingError
from thresher.models.source import ARTIFACT_DIR_TAG
from thresher.paths import state_dir

log = logging.getLogger(__name__)

ARTIFACT_HASH_TAG = "thresher.artifact_hash"
_MAX_PARAM = 500


def resolve_tracking_uri(explicit: str | None = None) -> str:
    if explicit:
        return explicit
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{state_dir() / 'mlflow.db'}"


def default_artifact_root() -> str:
    return (state_dir() / "mlartifacts").as_uri()


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, with the URI in the message, if the tracking store cannot be used."""
    if uri.startswith(("http://", "https://")):
        import httpx

        try:
            resp = httpx.get(uri.rstrip("/") + "/health", timeout=timeout)
            resp.raise_for_status()
        except Exception as err:
            raise TrackingError(
                f"MLflow tracking server {uri} is unreachable ({type(err).__name__}: {err}). "
                "Start it (`mlflow server ...`), fix MLFLOW_TRACKING_URI, or unset it to use the "
                "embedded SQLite store."
            ) from None
    elif uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts/lists -> dotted keys with string values (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, list) and value and isinstance(value[0], Mapping):
            for i, item in enumerate(value):
                out.update(flatten(item, f"{name}.{i}."))
        else:
            text = json.dumps(value) if isinstance(value, list) else str(value)
            out[name] = text[:_MAX_PARAM]
    return out


def git_sha() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class Tracker:
    """Thin, explicit-run-id wrapper over MlflowClient for the compress flow."""

    def __init__(self, uri: str | None, experiment: str):
        from mlflow.tracking import MlflowClient

        self.uri = resolve_tracking_uri(uri)
        check_reachable(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        try:
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(experiment, artifact_location=self._artifacts())
            )
        except Exception as err:
            raise TrackingError(f"MLflow at {self.uri} refused the experiment {experiment!r}: {err}"
                                ) from err
        self._monitors: dict[str, Any] = {}

    def _artifacts(self) -> str | None:
        # A local store keeps artifacts beside the database; a server decides for itself.
        return None if self.uri.startswith(("http://", "https://")) else default_artifact_root()

    def start_run(self, name: str, parent_id: str | None = None, tags: Mapping[str, str] | None = None,
                  system_metrics: bool = False) -> str:
        all_tags = {"thresher.version": __version__, **(tags or {})}
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        run_id = run.info.run_id
        if system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id, sampling_interval=5, samples_before_logging=1,
                                           tracking_uri=self.uri)
            monitor.start()
            self._monitors[run_id] = monitor
        return run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        monitor = self._monitors.pop(run_id, None)
        if monitor is not None:
            monitor.finish()
        self.client.set_terminated(run_id, status=status)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, v)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / name
            file.write_text(text)
            self.client.log_artifact(run_id, str(file))

    def register(self, name: str, artifact_dir: Path, artifact_hash: str, run_id: str,
                 tags: Mapping[str, str]) -> str:
        """A registry version for a published artifact (reused if that exact artifact is registered)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            self.client.create_registered_model(
                name, description="Compressed variants published by thresher")
        for mv in self.client.search_model_versions(f"name='{name}'"):
            if (mv.tags or {}).get(ARTIFACT_HASH_TAG) == artifact_hash:
                return str(mv.version)
        mv = self.client.create_model_version(
            name, source=Path(artifact_dir).resolve().as_uri(), run_id=run_id,
            tags={ARTIFACT_DIR_TAG: str(Path(artifact_dir).resolve()),
                  ARTIFACT_HASH_TAG: artifact_hash, **tags},
        )
        return str(mv.version)
