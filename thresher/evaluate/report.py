"""The comparison report over the variants of a flow run: a table and the plots worth looking at.

Quality against size with the Pareto frontier marked answers "which variants are worth keeping";
per-task bars show damage that perplexity hides; for pruned variants a heatmap of REAP saliency
per layer and expert, with the removed experts crossed out, shows what pruning took away. Each
plot's data is returned beside its file, so a test (or a notebook) can check what was drawn.

Records come from MLflow runs logged under the flow's naming contract (``collect_from_mlflow``):
metrics ``perplexity``, ``size_bytes``, ``bits_per_param``, ``compression_ratio``,
``experts_kept``, ``task/<task>/<metric>`` (and ``..._stderr``), ``validate/throughput_c16_tok_s``;
params ``variant`` and ``stages``; the artifact ``prune_report.json`` holding
``{"layers": [{"layer": i, "saliency": [...], "removed": [...]}]}``.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from thresher.errors import ArtifactError

log = logging.getLogger(__name__)

THROUGHPUT_METRIC = "validate/throughput_c16_tok_s"
PRUNE_REPORT = "prune_report.json"
HIGHER_IS_BETTER_TASK_METRICS = ("acc", "acc_norm", "exact_match", "f1", "mcc")


@dataclass(frozen=True)
class LayerSaliency:
    """REAP saliency of every expert of one layer (before pruning) and the experts removed."""

    layer: int
    saliency: list[float]
    removed: list[int]


@dataclass
class VariantRecord:
    """What the report knows about one variant; every measurement is optional."""

    name: str
    size_bytes: float | None = None
    bits_per_param: float | None = None
    compression_ratio: float | None = None
    experts_kept: float | None = None
    perplexity: float | None = None
    tasks: dict[str, float] = field(default_factory=dict)  # "<task>/<metric>" -> score
    task_stderr: dict[str, float] = field(default_factory=dict)
    throughput_tok_s: float | None = None
    stages: str = ""
    run_id: str | None = None
    saliency: list[LayerSaliency] | None = None

    @classmethod
    def from_metrics(cls, name: str, metrics: dict[str, float], params: dict[str, str] | None = None,
                     prune_report: dict[str, Any] | None = None,
                     run_id: str | None = None) -> VariantRecord:
        """A record from flat MLflow-style metrics and params (the flow's naming contract)."""
        params = params or {}
        tasks, stderr = {}, {}
        for key, value in metrics.items():
            if not key.startswith("task/"):
                continue
            name_ = key.removeprefix("task/")
            if name_.endswith("_stderr"):
                stderr[name_.removesuffix("_stderr")] = float(value)
            else:
                tasks[name_] = float(value)
        return cls(
            name=params.get("variant", name),
            size_bytes=metrics.get("size_bytes"), bits_per_param=metrics.get("bits_per_param"),
            compression_ratio=metrics.get("compression_ratio"),
            experts_kept=metrics.get("experts_kept"), perplexity=metrics.get("perplexity"),
            tasks=tasks, task_stderr=stderr, throughput_tok_s=metrics.get(THROUGHPUT_METRIC),
            stages=params.get("stages", ""), run_id=run_id,
            saliency=parse_prune_report(prune_report) if prune_report else None,
        )

    def metrics(self) -> dict[str, float]:
        """The record as flat metrics under the naming contract (the inverse of from_metrics)."""
        out = {k: float(v) for k, v in (
            ("size_bytes", self.size_bytes), ("bits_per_param", self.bits_per_param),
            ("compression_ratio", self.compression_ratio), ("experts_kept", self.experts_kept),
            ("perplexity", self.perplexity), (THROUGHPUT_METRIC, self.throughput_tok_s),
        ) if v is not None}
        out.update({f"task/{k}": v for k, v in self.tasks.items()})
        out.update({f"task/{k}_stderr": v for k, v in self.task_stderr.items()})
        return out


def parse_prune_report(data: dict[str, Any]) -> list[LayerSaliency]:
    """``prune_report.json`` -> per-layer saliency; refuses a report without the needed keys."""
    try:
        return [LayerSaliency(int(e["layer"]), [float(s) for s in e["saliency"]],
                              sorted(int(r) for r in e["removed"])) for e in data["layers"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ArtifactError(
            f"{PRUNE_REPORT}: expected {{'layers': [{{'layer', 'saliency', 'removed'}}]}}, "
            f"cannot read it ({err!r})") from err


# --- the data behind the plots -------------------------------------------------------------------


def pareto_front(points: list[tuple[str, float, float]], lower_is_better: bool) -> list[str]:
    """Names of the points no other point beats: no larger size and at least as good quality,
    one of the two strictly. ``points`` are (name, size, quality); the result runs by size."""
    sign = 1.0 if lower_is_better else -1.0
    front = []
    for name, x, y in points:
        dominated = any(
            (x2 <= x and sign * y2 <= sign * y) and (x2 < x or sign * y2 < sign * y)
            for n2, x2, y2 in points if n2 != name
        )
        if not dominated:
            front.append((x, name))
    return [name for _, name in sorted(front)]


def mean_task_score(record: VariantRecord, metric: str = "acc") -> float | None:
    """Mean of ``metric`` over the record's tasks (e.g. every ``<task>/acc``)."""
    values = [v for k, v in record.tasks.items() if k.rsplit("/", 1)[-1] == metric]
    return float(np.mean(values)) if values else None


def quality_vs_size_data(records: list[VariantRecord], task_metric: str = "acc") -> list[dict]:
    """One panel per quality measure every sized variant has: perplexity, mean task score."""
    sized = [r for r in records if r.size_bytes is not None]
    missing = [r.name for r in records if r.size_bytes is None]
    if missing:
        log.warning("no size_bytes for %s: left out of the quality-vs-size plot", ", ".join(missing))
    panels = []
    measures = [("perplexity", "held-out perplexity (lower is better)", True,
                 lambda r: r.perplexity),
                (f"mean task {task_metric}", f"mean task {task_metric} (higher is better)", False,
                 lambda r: mean_task_score(r, task_metric))]
    for name, label, lower, get in measures:
        points = [(r.name, float(r.size_bytes), get(r)) for r in sized]
        points = [(n, x, float(y)) for n, x, y in points if y is not None and math.isfinite(y)]
        if points:
            panels.append({"metric": name, "label": label, "lower_is_better": lower,
                           "points": points, "frontier": pareto_front(points, lower)})
    return panels


def task_bars_data(records: list[VariantRecord]) -> dict[str, Any]:
    """Scores per task metric (rows) and variant (columns); missing scores are NaN."""
    keys = sorted({k for r in records for k in r.tasks})
    return {
        "tasks": keys, "variants": [r.name for r in records],
        "values": [[r.tasks.get(k, math.nan) for r in records] for k in keys],
        "stderr": [[r.task_stderr.get(k, 0.0) for r in records] for k in keys],
    }


def saliency_data(records: list[VariantRecord]) -> dict[str, dict[str, Any]]:
    """Per pruned variant: the saliency matrix [layers x experts] and the removed (layer, expert)."""
    out = {}
    for r in records:
        if not r.saliency:
            continue
        width = max(len(layer.saliency) for layer in r.saliency)
        matrix = np.full((len(r.saliency), width), np.nan)
        for row, layer in enumerate(r.saliency):
            matrix[row, : len(layer.saliency)] = layer.saliency
        out[r.name] = {"layers": [layer.layer for layer in r.saliency],
                       "matrix": matrix.tolist(),
                       "removed": [(layer.layer, e) for layer in r.saliency for e in layer.removed]}
    return out


# --- drawing -------------------------------------------------------------------------------------


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_quality_vs_size(panels: list[dict], path: Path) -> Path:
    fig = Figure(figsize=(6.0 * max(1, len(panels)), 4.5))
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        front = set(panel["frontier"])
        for name, x, y in panel["points"]:
            on = name in front
            ax.scatter([x / 1e6], [y], s=60 if on else 35, zorder=3,
                       color="tab:red" if on else "tab:gray", edgecolor="black" if on else "none")
            ax.annotate(name, (x / 1e6, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        by_name = {n: (x, y) for n, x, y in panel["points"]}
        fx = [by_name[n][0] / 1e6 for n in panel["frontier"]]
        fy = [by_name[n][1] for n in panel["frontier"]]
        ax.step(fx, fy, where="post", color="tab:red", alpha=0.6, label="Pareto frontier")
        ys = [y for _, _, y in panel["points"]]
        if min(ys) > 0 and max(ys) / min(ys) > 10:
            ax.set_yscale("log")  # one wrecked control must not flatten the others
        ax.set_xlabel("size (MB)")
        ax.set_ylabel(panel["label"])
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("quality vs size")
    return _save(fig, path)


def plot_task_bars(data: dict[str, Any], path: Path) -> Path:
    tasks, variants = data["tasks"], data["variants"]
    fig = Figure(figsize=(max(6.0, 1.2 * len(tasks) * max(1, len(variants)) * 0.5 + 3), 4.5))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(variants))
    x = np.arange(len(tasks))
    for j, name in enumerate(variants):
        values = [data["values"][i][j] for i in range(len(tasks))]
        errs = [data["stderr"][i][j] for i in range(len(tasks))]
        ax.bar(x + j * width - 0.4 + width / 2, values, width, yerr=errs, capsize=2, label=name)
    ax.set_xticks(x)
    ax.set_xticklabels(tasks, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("score")
    ax.set_title("task scores per variant (error bars: one standard error)")
    ax.legend(fontsize=8, ncol=min(4, max(1, len(variants))))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_saliency(data: dict[str, dict[str, Any]], path: Path) -> Path:
    fig = Figure(figsize=(6.0 * len(data), 4.0))
    for i, (name, d) in enumerate(data.items()):
        ax = fig.add_subplot(1, len(data), i + 1)
        matrix = np.array(d["matrix"], dtype=float)
        image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
        row_of = {layer: row for row, layer in enumerate(d["layers"])}
        if d["removed"]:
            ax.scatter([e for _, e in d["removed"]], [row_of[layer] for layer, _ in d["removed"]],
                       marker="x", color="red", s=60, label="removed")
            ax.legend(loc="upper right", fontsize=8)
        ax.set_yticks(range(len(d["layers"])))
        ax.set_yticklabels(d["layers"])
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title(f"{name}: REAP saliency")
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(fig, path)


# --- the table and the report -------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def table_rows(records: list[VariantRecord]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table; task columns are the union over the variants."""
    tasks = sorted({k for r in records for k in r.tasks})
    header = ["variant", "stages", "size (MB)", "bits/param", "compression", "experts kept",
              "perplexity", *tasks, "throughput c16 (tok/s)"]
    rows = []
    for r in records:
        cells = [r.name, r.stages or "-",
                 _fmt(r.size_bytes / 1e6 if r.size_bytes is not None else None, 2),
                 _fmt(r.bits_per_param, 2), _fmt(r.compression_ratio, 2),
                 _fmt(r.experts_kept, 0), _fmt(r.perplexity, 2)]
        for k in tasks:
            value = r.tasks.get(k)
            err = r.task_stderr.get(k)
            cells.append(_fmt(value) + (f" ± {err:.3f}" if value is not None and err else ""))
        cells.append(_fmt(r.throughput_tok_s, 1))
        rows.append(cells)
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>\n</table>\n"


_CSS = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%;margin:1em 0}")


@dataclass
class Report:
    """The files written and the data each plot shows."""

    out_dir: Path
    files: dict[str, Path]
    header: list[str]
    rows: list[list[str]]
    quality_vs_size: list[dict]
    task_bars: dict[str, Any]
    saliency: dict[str, dict[str, Any]]


def build_report(records: Iterable[VariantRecord], out_dir: str | Path,
                 title: str = "thresher: variant comparison", task_metric: str = "acc") -> Report:
    """Write the table (markdown, HTML), the plots (PNG) and one self-contained report.html."""
    records = list(records)
    if not records:
        raise ArtifactError("comparison report: no variants to compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header, rows = table_rows(records)
    files = {"table_md": out / "comparison.md", "table_html": out / "comparison_table.html"}
    files["table_md"].write_text(f"# {title}\n\n" + markdown_table(header, rows))
    files["table_html"].write_text(html_table(header, rows))

    panels = quality_vs_size_data(records, task_metric)
    bars = task_bars_data(records)
    heat = saliency_data(records)
    if panels:
        files["quality_vs_size"] = plot_quality_vs_size(panels, out / "quality_vs_size.png")
    if bars["tasks"]:
        files["task_scores"] = plot_task_bars(bars, out / "task_scores.png")
    if heat:
        files["saliency"] = plot_saliency(heat, out / "saliency.png")

    sections = [f"<h1>{html.escape(title)}</h1>", html_table(header, rows)]
    for key, caption in (("quality_vs_size", "Quality vs size (Pareto frontier in red)"),
                         ("task_scores", "Task scores"),
                         ("saliency", "REAP saliency per layer and expert (x: removed)")):
        if key in files:
            png = base64.b64encode(files[key].read_bytes()).decode()
            sections.append(f"<h2>{caption}</h2><img alt='{key}' src='data:image/png;base64,{png}'>")
    files["html"] = out / "report.html"
    files["html"].write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>"
                             f"{html.escape(title)}</title><style>{_CSS}</style></head><body>"
                             + "\n".join(sections) + "</body></html>\n")
    (out / "report_data.json").write_text(json.dumps(
        {"quality_vs_size": panels, "task_bars": bars, "saliency": heat}, indent=1))
    files["data"] = out / "report_data.json"
    log.info("comparison report for %d variants in %s", len(records), out)
    return Report(out_dir=out, files=files, header=header, rows=rows, quality_vs_size=panels,
                  task_bars=bars, saliency=heat)


# --- MLflow --------------------------------------------------------------------------------------


def collect_from_mlflow(run_ids: list[str], tracking_uri: str | None = None) -> list[VariantRecord]:
    """Variant records from MLflow runs; a run with child runs (a flow's parent) expands to them."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    records = []
    for run_id in run_ids:
        try:
            run = client.get_run(run_id)
        except MlflowException as err:
            raise ArtifactError(f"MLflow run {run_id!r}: not found in "
                                f"{client.tracking_uri} ({err.message})") from err
        children = client.search_runs(
            [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'",
            order_by=["attributes.start_time ASC"])
        for r in children or [run]:
            records.append(_record_from_run(client, r))
    return records


def _record_from_run(client, run) -> VariantRecord:
    prune = _find_artifact(client, run.info.run_id, PRUNE_REPORT)
    return VariantRecord.from_metrics(
        run.info.run_name or run.info.run_id, dict(run.data.metrics), dict(run.data.params),
        prune_report=prune, run_id=run.info.run_id)


def _find_artifact(client, run_id: str, name: str, path: str = "", depth: int = 2) -> dict | None:
    """The JSON artifact ``name`` at the run's root or up to ``depth`` folders down, if any."""
    import tempfile

    for item in client.list_artifacts(run_id, path or None):
        if not item.is_dir and Path(item.path).name == name:
            with tempfile.TemporaryDirectory() as tmp:
                local = client.download_artifacts(run_id, item.path, tmp)
                return json.loads(Path(local).read_text())
    if depth > 0:
        for item in client.list_artifacts(run_id, path or None):
            if item.is_dir:
                found = _find_artifact(client, run_id, name, item.path, depth - 1)
                if found is not None:
                    return found
    return None


def log_report(report: Report, run_id: str, tracking_uri: str | None = None,
               artifact_path: str = "comparison") -> None:
    """Attach the report's files to an MLflow run (the flow's parent run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for path in report.files.values():
        client.log_artifact(run_id, str(path), artifact_path)
