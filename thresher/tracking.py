"""MLflow, reached from one place: tracking runs, reading them back, the model registry.

The compress flow writes one parent run per flow run and one nested run per variant; the
comparison report reads those runs back and logs its files; ``models:/name/version`` sources are
looked up in the registry. All of it goes through here, and MLflow is imported only when used.

Every call names its run id explicitly (``MlflowClient``), never MLflow's active run: Prefect runs
tasks on worker threads and MLflow's active run is thread-local. The tracking URI follows MLflow's
convention: an explicit URI (recipe or CLI), else MLflow's own setting (``mlflow.set_tracking_uri``
or ``$MLFLOW_TRACKING_URI``), else the embedded default, a SQLite file under thresher's state
directory. Reachability is checked before any compute, so a wrong URI fails in a second, not after
hours of calibration.
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thresher import __version__
from thresher.errors import ArtifactError, ModelError, TrackingError
from thresher.paths import tracking_artifacts_uri, tracking_store_uri

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion

log = logging.getLogger(__name__)

ARTIFACT_DIR_TAG = "thresher.artifact_dir"
ARTIFACT_HASH_TAG = "thresher.artifact_hash"
MODEL_URI_TAG = "thresher.model_uri"
REFERENCE_TAG = "thresher.reference"  # the base evaluated for a recipe without a base variant
_MAX_PARAM = 500


def resolve_tracking_uri(explicit: str | None = None) -> str:
    """The tracking URI to use: ``explicit``, else MLflow's setting, else the embedded store."""
    if explicit:
        return explicit
    import mlflow

    if mlflow.tracking.is_tracking_uri_set():
        return mlflow.get_tracking_uri()
    return tracking_store_uri()


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


def run_page(uri: str, experiment_id: str, run_id: str) -> tuple[str, str | None]:
    """A run's page in the MLflow UI, and the command that serves that UI when ``uri`` is a store
    (a SQLite file, a directory) rather than a server, on MLflow's default port."""
    route = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{route}", None
    return f"http://127.0.0.1:5000/{route}", f"mlflow ui --backend-store-uri {uri}"


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
    """The commit of the thresher source that is running, when it runs from a git checkout; None
    for an installed wheel (even one installed in a virtualenv inside some other repository)."""
    package = str(Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", package, *args], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()

    try:
        git("ls-files", "--error-unmatch", "tracking.py")  # this file is tracked: a checkout
        return git("rev-parse", "HEAD") or None
    except (OSError, subprocess.SubprocessError):
        return None


class Tracker:
    """Thin, explicit-run-id wrapper over MlflowClient.

    With an ``experiment`` it can start runs (the compress flow); without one it reads runs, logs
    files to existing runs and looks up registered models (the report, model sources).
    """

    def __init__(self, uri: str | None = None, experiment: str | None = None):
        from mlflow.tracking import MlflowClient

        self.uri = resolve_tracking_uri(uri)
        check_reachable(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.experiment_id: str | None = None
        if experiment is not None:
            try:
                found = self.client.get_experiment_by_name(experiment)
                self.experiment_id = (
                    found.experiment_id
                    if found is not None
                    else self.client.create_experiment(experiment,
                                                       artifact_location=self._artifacts())
                )
            except Exception as err:
                raise TrackingError(f"MLflow at {self.uri} refused the experiment "
                                    f"{experiment!r}: {err}") from err
        self._monitors: dict[str, Any] = {}

    def _artifacts(self) -> str | None:
        # A local store keeps artifacts beside the database; a server decides for itself.
        return None if self.uri.startswith(("http://", "https://")) else tracking_artifacts_uri()

    # --- writing runs ----------------------------------------------------------------------------

    def start_run(self, name: str, parent_id: str | None = None, tags: Mapping[str, str] | None = None,
                  system_metrics: bool = False) -> str:
        if self.experiment_id is None:
            raise TrackingError("a Tracker made without an experiment cannot start runs")
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

    # --- reading runs ----------------------------------------------------------------------------

    def get_run(self, run_id: str) -> Run:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException as err:
            raise ArtifactError(f"MLflow run {run_id!r}: not found in {self.uri} "
                                f"({err.message})") from err

    def variant_runs(self, run_id: str) -> list[Run]:
        """The run's child runs in start order (a flow's parent run), else the run itself."""
        run = self.get_run(run_id)
        children = self.client.search_runs(
            [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'",
            order_by=["attributes.start_time ASC"])
        return list(children) or [run]

    def find_json_artifact(self, run_id: str, name: str, path: str = "",
                           depth: int = 2) -> dict | None:
        """The JSON artifact ``name`` at the run's root or up to ``depth`` folders down, if any."""
        items = self.client.list_artifacts(run_id, path or None)
        for item in items:
            if not item.is_dir and Path(item.path).name == name:
                with tempfile.TemporaryDirectory() as tmp:
                    local = self.client.download_artifacts(run_id, item.path, tmp)
                    return json.loads(Path(local).read_text())
        if depth > 0:
            for item in items:
                if item.is_dir:
                    found = self.find_json_artifact(run_id, name, item.path, depth - 1)
                    if found is not None:
                        return found
        return None

    # --- the model registry ----------------------------------------------------------------------

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

    def set_alias(self, name: str, alias: str, version: str) -> None:
        """Point ``models:/name@alias`` at ``version`` (moved there if it pointed elsewhere)."""
        self.client.set_registered_model_alias(name, alias, version)

    def model_version(self, name_version: str) -> ModelVersion:
        """The registry entry of ``name/version`` or ``name@alias`` (a ``models:/`` URI's tail)."""
        if "@" not in name_version and "/" not in name_version.strip("/"):
            raise ModelError(f"models:/{name_version}: a registry URI names a version or an "
                             "alias: models:/NAME/VERSION or models:/NAME@ALIAS")
        try:
            if "@" in name_version:
                name, alias = name_version.split("@", 1)
                return self.client.get_model_version_by_alias(name, alias)
            name, version = name_version.rsplit("/", 1)
            return self.client.get_model_version(name, version)
        except Exception as err:
            raise ModelError(f"models:/{name_version}: not found in the MLflow registry at "
                             f"{self.uri} ({err})") from err

    def download_model(self, name_version: str) -> Path:
        """A local copy of the files registered as ``models:/name_version``."""
        import mlflow

        return Path(mlflow.artifacts.download_artifacts(f"models:/{name_version}",
                                                        tracking_uri=self.uri,
                                                        registry_uri=self.uri))
