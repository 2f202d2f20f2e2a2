"""The comparison report over the variants of a flow run: a table and the plots worth looking at.

Quality against size with the Pareto frontier marked answers "which variants are worth keeping";
per-task bars show damage that perplexity hides; for pruned variants a heatmap of REAP saliency
per layer and expert, with the removed experts crossed out, shows what pruning took away. Each
plot's data is returned beside its file, so a test (or a notebook) can check what was drawn.

The compress flow builds the records as it runs; ``collect_from_mlflow`` builds the same records
from MLflow runs logged under the flow's naming contract: metrics ``perplexity``, ``size_bytes``,
``bits_per_param``, ``compression_ratio``, ``experts_kept``, ``task/<task>/<metric>`` (and
``..._stderr``), ``validate/<measure>`` (``validate/draft_acceptance_rate``,
``validate/speculative_tokens_per_s`` and ``validate/speculative_speedup``: the variant as a
speculative-decoding draft of the base; ``validate/with_draft/<measure>``: the variant served
with its own draft); params ``variant``, ``stages`` and ``validate.draft``; tags
``thresher.artifact_dir`` and ``thresher.model_uri``; the artifact ``prune_report.json`` holding
``{"layers": [{"layer": i, "saliency": [...], "removed": [...]}]}``; ``window_nll.json`` (the
per-window NLLs the perplexity change from the base is paired on); ``gguf/<type>/<measure>`` for
each published GGUF file whose weights were evaluated. The full table (``thresher compare``,
markdown, HTML, the flow run's summary) comes from ``comparison_table``; the compact one that
``thresher run`` and ``thresher demo`` print in a terminal from ``terminal_table``.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from thresher.errors import ArtifactError
from thresher.evaluate.significance import (
    PairedDifference,
    PairedPerplexity,
    paired_difference,
    paired_documents,
    paired_perplexity,
)
from thresher.formats.artifact import (
    COMPARISON_HTML,
    COMPARISON_MD,
    PRUNE_REPORT,
    REPORT_ARTIFACT_PATH,
    REPORT_DATA,
    REPORT_HTML,
    TASK_SAMPLES,
    WINDOW_NLL,
)
from thresher.tracking import ARTIFACT_DIR_TAG, MODEL_URI_TAG, Tracker

log = logging.getLogger(__name__)

VALIDATE_PREFIX = "validate/"
DRAFT_ACCEPTANCE = "draft_acceptance_rate"  # validate/...: the variant as a draft of the base
SPECULATIVE_TOK_S = "speculative_tokens_per_s"  # validate/...: the base with it drafting
SPECULATIVE_SPEEDUP = "speculative_speedup"  # ... over the base's plain decoding
DRAFTED_PREFIX = "validate/with_draft/"  # the variant served with its own named draft
THROUGHPUT_METRIC = "validate/throughput_c16_tok_s"
BASE_STAGES = "base"  # the stage chain of a variant without stages
GGUF_PREFIX = "gguf/"  # gguf/<type>/<measure>: a published GGUF file of the variant
OWN_NLL = "perplexity"  # window_nll key of the variant's own weights (gguf/<type>: its GGUF's)
TERMINAL_WIDTH = 120
_TYPED_METRICS = ("size_bytes", "bits_per_param", "compression_ratio", "experts_kept",
                  "perplexity")
HIGHER_IS_BETTER_TASK_METRICS = ("acc", "acc_norm", "exact_match", "f1", "mcc")


@dataclass(frozen=True)
class LayerSaliency:
    """REAP saliency of every expert of one layer (before pruning) and the experts removed."""

    layer: int
    saliency: list[float]
    removed: list[int]


@dataclass
class VariantRecord:
    """What the report knows about one variant; every measurement is optional.

    ``validation`` holds the engine's validation run (``validate/<measure>`` without the prefix);
    ``other_metrics`` every further flat metric (stage timings, cache hits, ...), so a record
    carries all of a variant's metrics and ``metrics()`` gives them back under the contract.
    """

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
    validation: dict[str, float] = field(default_factory=dict)
    other_metrics: dict[str, float] = field(default_factory=dict)
    artifact: str | None = None
    model_uri: str | None = None
    # "<task>/<metric>" -> {document key: score} (TaskResults.per_sample), for the comparison
    # with the base paired by document; the flow logs them as the run's TASK_SAMPLES artifact
    task_samples: dict[str, dict[str, float]] = field(default_factory=dict)
    # OWN_NLL or "gguf/<type>" -> mean NLL per held-out window, paired with the base's
    window_nll: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, name: str, metrics: dict[str, float], params: dict[str, str] | None = None,
                     prune_report: dict[str, Any] | None = None, run_id: str | None = None,
                     artifact: str | None = None, model_uri: str | None = None,
                     task_samples: dict[str, dict[str, float]] | None = None,
                     window_nll: dict[str, list[float]] | None = None) -> VariantRecord:
        """A record from flat MLflow-style metrics and params (the flow's naming contract)."""
        params = params or {}
        tasks, stderr, validation, other = {}, {}, {}, {}
        for key, value in metrics.items():
            if key.startswith("task/"):
                name_ = key.removeprefix("task/")
                if name_.endswith("_stderr"):
                    stderr[name_.removesuffix("_stderr")] = float(value)
                else:
                    tasks[name_] = float(value)
            elif key.startswith(VALIDATE_PREFIX):
                validation[key.removeprefix(VALIDATE_PREFIX)] = float(value)
            elif key not in _TYPED_METRICS:
                other[key] = float(value)
        return cls(
            name=params.get("variant", name),
            size_bytes=metrics.get("size_bytes"), bits_per_param=metrics.get("bits_per_param"),
            compression_ratio=metrics.get("compression_ratio"),
            experts_kept=metrics.get("experts_kept"), perplexity=metrics.get("perplexity"),
            tasks=tasks, task_stderr=stderr, throughput_tok_s=metrics.get(THROUGHPUT_METRIC),
            stages=params.get("stages", ""), run_id=run_id,
            saliency=parse_prune_report(prune_report) if prune_report else None,
            validation=validation, other_metrics=other, artifact=artifact, model_uri=model_uri,
            task_samples=dict(task_samples or {}), window_nll=dict(window_nll or {}),
        )

    def metrics(self) -> dict[str, float]:
        """The record as flat metrics under the naming contract (the inverse of from_metrics)."""
        out = dict(self.other_metrics)
        out.update({k: float(v) for k, v in (
            ("size_bytes", self.size_bytes), ("bits_per_param", self.bits_per_param),
            ("compression_ratio", self.compression_ratio), ("experts_kept", self.experts_kept),
            ("perplexity", self.perplexity),
        ) if v is not None})
        out.update({f"task/{k}": v for k, v in self.tasks.items()})
        out.update({f"task/{k}_stderr": v for k, v in self.task_stderr.items()})
        out.update({f"{VALIDATE_PREFIX}{k}": v for k, v in self.validation.items()})
        if self.throughput_tok_s is not None:
            out[THROUGHPUT_METRIC] = float(self.throughput_tok_s)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the flow's result): identity fields beside the flat metrics; a field
        that is unknown (no registry, no artifact) is left out."""
        ids = {"variant": self.name, "stages": self.stages, "run_id": self.run_id,
               "artifact": self.artifact, "model_uri": self.model_uri,
               "task_samples": self.task_samples or None, "window_nll": self.window_nll or None}
        return {**{k: v for k, v in ids.items() if v is not None}, **self.metrics()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VariantRecord:
        """The inverse of ``to_dict`` (the saliency stays with the artifact's prune report)."""
        ids = ("variant", "stages", "run_id", "artifact", "model_uri", "task_samples",
               "window_nll")
        return cls.from_metrics(data["variant"], {k: v for k, v in data.items() if k not in ids},
                                {"variant": data["variant"], "stages": data.get("stages", "")},
                                run_id=data.get("run_id"), artifact=data.get("artifact"),
                                model_uri=data.get("model_uri"),
                                task_samples=data.get("task_samples"),
                                window_nll=data.get("window_nll"))

    def gguf_files(self) -> list[GGUFMeasure]:
        """The variant's published GGUF files whose weights were evaluated, by type."""
        by_type: dict[str, dict[str, float]] = {}
        for key, value in self.other_metrics.items():
            if key.startswith(GGUF_PREFIX) and key.count("/") == 2:
                gguf_type, measure = key.removeprefix(GGUF_PREFIX).split("/")
                by_type.setdefault(gguf_type, {})[measure] = value
        params = self.other_metrics.get("parameters")
        return [GGUFMeasure(self.name, t, m["perplexity"], m.get("size_bytes"),
                            8.0 * m["size_bytes"] / params if params and "size_bytes" in m
                            else None, bool(m.get("requantized", 0.0)))
                for t, m in sorted(by_type.items()) if "perplexity" in m]


@dataclass(frozen=True)
class GGUFMeasure:
    """One published GGUF file of a variant, its weights dequantized and evaluated by thresher:
    ``requantized`` when the variant was already quantized (the file is a second rounding)."""

    variant: str
    type: str
    perplexity: float
    size_bytes: float | None
    bits_per_param: float | None
    requantized: bool

    @property
    def nll_key(self) -> str:
        return f"{GGUF_PREFIX}{self.type}"

    @property
    def label(self) -> str:
        return f"{self.variant}-{self.type}.gguf"

    @property
    def stages(self) -> str:
        how = "requantized: second rounding" if self.requantized else "quantized from 16-bit"
        return f"GGUF {self.type} ({how})"


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
    measures = [("perplexity", "perplexity on the evaluation text (lower is better)", True,
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
    """Per distinct pruning: the saliency matrix [layers x experts], the removed (layer, expert)
    and the variants that share it (quantized children of one pruned model carry its report),
    keyed by those variants' names joined with ", "."""
    groups: dict[str, dict[str, Any]] = {}
    for r in records:
        if not r.saliency:
            continue
        same = json.dumps([(layer.layer, layer.saliency, layer.removed) for layer in r.saliency])
        if same in groups:
            groups[same]["variants"].append(r.name)
            continue
        width = max(len(layer.saliency) for layer in r.saliency)
        matrix = np.full((len(r.saliency), width), np.nan)
        for row, layer in enumerate(r.saliency):
            matrix[row, : len(layer.saliency)] = layer.saliency
        groups[same] = {"variants": [r.name], "layers": [layer.layer for layer in r.saliency],
                        "matrix": matrix.tolist(),
                        "removed": [(layer.layer, e) for layer in r.saliency for e in layer.removed]}
    return {", ".join(g["variants"]): g for g in groups.values()}


# --- drawing -------------------------------------------------------------------------------------


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


_DPI = 110  # the figure's own, so labels are measured at the resolution they are saved at
_LABEL_FONT = 8
_POINT_CLEARANCE_PX = 6.0  # half-width of the square kept free of labels around each point
_LABEL_RADII_PX = (4.0, 14.0, 26.0, 40.0, 56.0, 74.0)  # beyond the first, a leader line is drawn
_NAME_RADII = 3  # names stay close to their points; farther out, numbers and a key read better
_LABEL_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))


def _overlaps(a: tuple[float, ...], b: tuple[float, ...], pad: float = 1.0) -> bool:
    return a[0] < b[2] + pad and b[0] < a[2] + pad and a[1] < b[3] + pad and b[1] < a[3] + pad


def _label_spots(ax, xy: np.ndarray, texts: list[str], radii: tuple[float, ...], force: bool
                 ) -> list[tuple[float, float, str, str, bool]] | None:
    """Where to put each point's label (pixel offset, alignment, whether it needs a leader line)
    so that no label overlaps another label, any point or the axes' edge; the most crowded points
    choose first. None when some label finds no free spot, unless ``force`` (then it takes the
    spot that overlaps least)."""
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pts = ax.transData.transform(xy)
    sizes = []
    for t in texts:
        probe = ax.text(0, 0, t, fontsize=_LABEL_FONT)
        box = probe.get_window_extent(renderer)
        probe.remove()
        sizes.append((box.width, box.height))
    c = _POINT_CLEARANCE_PX
    taken = [(x - c, y - c, x + c, y + c) for x, y in pts]
    crowding = (np.linalg.norm(pts[:, None] - pts[None], axis=-1) < 80).sum(axis=1)
    spots: list = [None] * len(texts)
    for i in sorted(range(len(texts)), key=lambda i: -crowding[i]):
        (x, y), (w, h) = pts[i], sizes[i]
        best, best_hits = None, None
        for r in radii:
            for sx, sy in _LABEL_DIRECTIONS:
                anchor_x, anchor_y = x + sx * (r + c), y + sy * (r + c)
                x0 = anchor_x - (0.0 if sx > 0 else w if sx < 0 else w / 2)
                y0 = anchor_y - (0.0 if sy > 0 else h if sy < 0 else h / 2)
                box = (x0, y0, x0 + w, y0 + h)
                inside = (box[0] >= frame.x0 and box[2] <= frame.x1 and box[1] >= frame.y0
                          and box[3] <= frame.y1)
                hits = sum(_overlaps(box, t) for t in taken) + (0 if inside else 100)
                if best_hits is None or hits < best_hits:
                    best_hits = hits
                    best = (box, (anchor_x - x, anchor_y - y,
                                  "left" if sx > 0 else "right" if sx < 0 else "center",
                                  "bottom" if sy > 0 else "top" if sy < 0 else "center",
                                  r > _LABEL_RADII_PX[0]))
                if hits == 0:
                    break
            if best_hits == 0:
                break
        if best_hits and not force:
            return None
        taken.append(best[0])
        spots[i] = best[1]
    return spots


def _draw_quality_vs_size(panels: list[dict], numbered: bool) -> Figure | None:
    """The figure with every point labelled by its name, or (``numbered``) by a number keyed in
    a table beside the panels. None when the names cannot be placed without overlapping."""
    names = list(dict.fromkeys(n for panel in panels for n, _, _ in panel["points"]))
    number = {n: str(i + 1) for i, n in enumerate(names)}
    key_columns = math.ceil(len(names) / 30) if numbered else 0
    width = 6.0 * max(1, len(panels)) + 1.6 * key_columns
    fig = Figure(figsize=(width, 4.5), dpi=_DPI)
    FigureCanvasAgg(fig)  # a renderer, to measure the labels before placing them
    fig.subplots_adjust(right=0.92 - 1.6 * key_columns / width)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        front = set(panel["frontier"])
        xy = np.array([(x / 1e6, y) for _, x, y in panel["points"]])
        on = np.array([n in front for n, _, _ in panel["points"]])
        ax.scatter(xy[~on, 0], xy[~on, 1], s=35, zorder=3, color="tab:gray")
        ax.scatter(xy[on, 0], xy[on, 1], s=60, zorder=3, color="tab:red", edgecolor="black")
        by_name = {n: (x / 1e6, y) for n, x, y in panel["points"]}
        ax.step([by_name[n][0] for n in panel["frontier"]],
                [by_name[n][1] for n in panel["frontier"]],
                where="post", color="tab:red", alpha=0.6, label="Pareto frontier")
        if xy[:, 1].min() > 0 and xy[:, 1].max() / xy[:, 1].min() > 10:
            ax.set_yscale("log")  # one wrecked control must not flatten the others
        ax.margins(0.2)
        ax.autoscale_view()
        ax.set_xlim(ax.get_xlim())  # fixed now: the labels are placed in pixels
        ax.set_ylim(ax.get_ylim())
        ax.set_xlabel("size (MB)")
        ax.set_ylabel(panel["label"])
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        texts = [number[n] if numbered else n for n, _, _ in panel["points"]]
        radii = _LABEL_RADII_PX if numbered else _LABEL_RADII_PX[:_NAME_RADII]
        spots = _label_spots(ax, xy, texts, radii, force=numbered)
        if spots is None:
            return None
        for text, (px, py), (dx, dy, ha, va, leader) in zip(texts, xy, spots, strict=True):
            ax.annotate(text, (px, py), xytext=(dx * 72 / _DPI, dy * 72 / _DPI),
                        textcoords="offset points", ha=ha, va=va, fontsize=_LABEL_FONT,
                        arrowprops={"arrowstyle": "-", "color": "0.55", "lw": 0.6}
                        if leader else None)
    rows = [f"{number[n]:>3}  {n}" for n in names]
    for col in range(key_columns):  # the key, right of the panels
        fig.text(0.93 - 1.6 * (key_columns - col) / width, 0.88,
                 "\n".join(rows[col * 30:(col + 1) * 30]), va="top", ha="left",
                 fontsize=_LABEL_FONT, family="monospace")
    fig.suptitle("quality vs size")
    return fig


def draw_quality_vs_size(panels: list[dict]) -> Figure:
    """Quality against size, one panel per measure, the Pareto frontier in red. Each point carries
    its name where the names fit without overlapping anything, else a number and a key."""
    fig = _draw_quality_vs_size(panels, numbered=False)
    return fig if fig is not None else _draw_quality_vs_size(panels, numbered=True)


def plot_quality_vs_size(panels: list[dict], path: Path) -> Path:
    return _save(draw_quality_vs_size(panels), path)


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
    """One heatmap per distinct pruning, titled with the variants that share it."""
    cols = min(3, len(data))
    rows = math.ceil(len(data) / cols)
    fig = Figure(figsize=(6.0 * cols, 4.4 * rows))
    for i, (name, d) in enumerate(data.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        matrix = np.array(d["matrix"], dtype=float)
        image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
        row_of = {layer: row for row, layer in enumerate(d["layers"])}
        if d["removed"]:
            ax.scatter([e for _, e in d["removed"]], [row_of[layer] for layer, _ in d["removed"]],
                       marker="x", color="red", s=60)
        ax.set_yticks(range(len(d["layers"])))
        ax.set_yticklabels(d["layers"])
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title(textwrap.fill(name, 60, break_on_hyphens=False),
                     fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle("REAP saliency per layer and expert (x: removed)")
    fig.tight_layout()
    return _save(fig, path)


# --- the table and the report -------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def validation_columns(records: list[VariantRecord]) -> dict[str, list[str]]:
    """The validation run's columns of the comparison table (none when validation was off).

    Agreement with the base, engine throughput at the highest load-test concurrency and TTFT
    at the lowest, one cell per record.
    """
    measured = [r.metrics() for r in records]
    levels = sorted({int(k.removeprefix("validate/throughput_c").removesuffix("_tok_s"))
                     for m in measured for k in m if k.startswith("validate/throughput_c")})
    if not levels:
        return {}
    hi, lo = levels[-1], levels[0]

    def cells(key: str, fmt: str) -> list[str]:
        return [format(m[key], fmt) if key in m else "-" for m in measured]

    columns = {
        "agreement": cells("validate/agreement", ".3f"),
        f"tok/s @c{hi}": cells(f"validate/throughput_c{hi}_tok_s", ".1f"),
        f"TTFT p50 ms @c{lo}": cells(f"validate/ttft_p50_ms_c{lo}", ".0f"),
    }
    return columns | speculative_columns(measured)


def speculative_columns(measured: list[dict[str, float]]) -> dict[str, list[str]]:
    """Speculative decoding's columns, each only where some variant has it: the variant's
    acceptance rate as a draft of the base, the base's tokens/s with it drafting (and the ratio
    to plain decoding), and the variant served with its own draft (``validate.draft``)."""
    def spec(m: dict[str, float], prefix: str) -> str:
        rate = m.get(f"{prefix}{SPECULATIVE_TOK_S}")
        if rate is None:
            return "-"
        speedup = m.get(f"{prefix}{SPECULATIVE_SPEEDUP}")
        return f"{rate:.1f}" + (f" ({speedup:.2f}x)" if speedup is not None else "")

    columns: dict[str, list[str]] = {}
    own = VALIDATE_PREFIX
    if any(f"{own}{DRAFT_ACCEPTANCE}" in m for m in measured):
        columns["acceptance as draft"] = [_fmt(m.get(f"{own}{DRAFT_ACCEPTANCE}")) for m in measured]
        columns["speculative tok/s (base, this draft)"] = [spec(m, own) for m in measured]
    if any(f"{DRAFTED_PREFIX}{DRAFT_ACCEPTANCE}" in m for m in measured):
        columns["with its draft: acceptance"] = [_fmt(m.get(f"{DRAFTED_PREFIX}{DRAFT_ACCEPTANCE}"))
                                                 for m in measured]
        columns["with its draft: speculative tok/s"] = [spec(m, DRAFTED_PREFIX) for m in measured]
    return columns


def paired_deltas(records: list[VariantRecord]) -> dict[str, dict[str, PairedDifference]]:
    """Per variant and ``<task>/<metric>``: the paired difference from the base variant (the
    one whose stages are ``base``), matched document by document; a variant scored on other
    documents than the base is refused (EvaluationError). Scores kept as a plain list (no
    document keys) cannot be matched and get no interval."""
    base = reference_record(records)
    if base is None:
        return {}
    out: dict[str, dict[str, PairedDifference]] = {}
    for r in records:
        if r is base:
            continue
        for key, scores in sorted(r.task_samples.items()):
            reference = base.task_samples.get(key)
            if not isinstance(reference, dict) or not isinstance(scores, dict) or not scores:
                continue
            base_scores, variant_scores = paired_documents(reference, scores, f"{r.name} {key}")
            out.setdefault(r.name, {})[key] = paired_difference(base_scores, variant_scores)
    return out


def paired_deltas_data(records: list[VariantRecord]) -> dict[str, Any]:
    """The paired differences as plot data: per ``<task>/<metric>`` and variant, the difference,
    its interval and whether it is beyond noise (the dashboard's paired-difference panel)."""
    paired = paired_deltas(records)
    keys = sorted({k for by_key in paired.values() for k in by_key})
    return {"metrics": keys, "variants": list(paired),
            "points": [[{"delta": d.delta, "low": d.low, "high": d.high,
                         "beyond_noise": d.beyond_noise} if (d := paired[v].get(k)) else None
                        for v in paired] for k in keys]}


def plot_paired_deltas(data: dict[str, Any], path: Path) -> Path:
    """One panel per task metric: each variant's difference from the base with its 95% paired
    interval; red where the interval excludes zero."""
    keys, variants = data["metrics"], data["variants"]
    fig = Figure(figsize=(4.5 * len(keys), 0.5 * len(variants) + 1.8))
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        for row, point in enumerate(data["points"][i]):
            if point is None:
                continue
            color = "tab:red" if point["beyond_noise"] else "tab:gray"
            ax.errorbar([point["delta"]], [row], capsize=3, fmt="o", color=color,
                        xerr=[[point["delta"] - point["low"]], [point["high"] - point["delta"]]])
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(variants)))
        ax.set_yticklabels(variants if i == 0 else [""] * len(variants), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("Δ vs base (95% paired CI)")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("paired difference from the base (red: beyond noise)")
    return _save(fig, path)


def reference_record(records: list[VariantRecord]) -> VariantRecord | None:
    """The base model's record (stages ``base``): the row every difference is taken from."""
    return next((r for r in records if r.stages == BASE_STAGES), None)


def perplexity_change(base: VariantRecord | None, record: VariantRecord,
                      key: str = OWN_NLL) -> PairedPerplexity | None:
    """The perplexity change of ``record``'s weights (``key``: its own, or a GGUF file's) from
    the base's, paired window by window; None unless both were scored on the same windows."""
    if base is None:
        return None
    ours, theirs = record.window_nll.get(key), base.window_nll.get(OWN_NLL)
    if not ours or not theirs or len(ours) != len(theirs):
        return None
    return paired_perplexity(theirs, ours)


def _vs_base(base: VariantRecord | None, record: VariantRecord, perplexity: float | None,
             key: str = OWN_NLL, is_base: bool = False) -> str:
    """``+1.23% [+0.50, +2.01]*``: the change with its 95% paired interval (* beyond noise); the
    plain ratio where no windows pair up; ``reference`` on the base's own row."""
    if is_base:
        return "reference"
    paired = perplexity_change(base, record, key)
    if paired is not None:
        d, lo, hi = (100 * x for x in paired.ratio)
        return f"{d:+.2f}% [{lo:+.2f}, {hi:+.2f}]" + ("*" if paired.nll.beyond_noise else "")
    if base is None or not base.perplexity or perplexity is None:
        return "-"
    return f"{100 * (perplexity / base.perplexity - 1):+.2f}%"


def _mb(size: float | None) -> float | None:
    return size / 1e6 if size is not None else None


def comparison_table(records: list[VariantRecord]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the full comparison table: size, quality against the base (the record
    whose stages are ``base``, marked ``reference``), task scores (the union over the variants),
    validation, and a row under each variant for every GGUF file whose weights were evaluated.

    ``vs base`` is the perplexity change with its 95% interval paired over the held-out windows.
    A task cell is ``score ± stderr``; where the variant and the base kept per-document scores,
    it adds ``Δ vs base [95% CI]`` of the paired difference, starred when beyond noise."""
    base = reference_record(records)
    paired = paired_deltas(records)
    tasks = sorted({k for r in records for k in r.tasks})
    extra = validation_columns(records)
    header = ["variant", "stages", "size (MB)", "bits/param", "experts", "perplexity",
              "vs base (95% CI)", *tasks, *extra]
    rows = []
    for i, r in enumerate(records):
        cells = [r.name, r.stages or "-", _fmt(_mb(r.size_bytes), 2),
                 _fmt(r.bits_per_param, 2), _fmt(r.experts_kept, 0), _fmt(r.perplexity),
                 _vs_base(base, r, r.perplexity, is_base=r is base)]
        for k in tasks:
            value = r.tasks.get(k)
            err = r.task_stderr.get(k)
            cell = _fmt(value) + (f" ± {err:.3f}" if value is not None and err else "")
            if k in paired.get(r.name, {}):
                cell += f", Δ {paired[r.name][k].describe()}"
            cells.append(cell)
        cells += [column[i] for column in extra.values()]
        rows.append(cells)
        for g in r.gguf_files():
            rows.append([g.label, g.stages, _fmt(_mb(g.size_bytes), 2), _fmt(g.bits_per_param, 2),
                         _fmt(r.experts_kept, 0), _fmt(g.perplexity),
                         _vs_base(base, r, g.perplexity, g.nll_key),
                         *["-"] * (len(tasks) + len(extra))])
    return header, rows


def terminal_table(records: list[VariantRecord], width: int = TERMINAL_WIDTH) -> str:
    """The comparison as a compact text table that fits ``width`` columns: variant, size,
    bits/param, perplexity with its change from the base and interval, one short column per task
    score (full names in the key below it) and engine tokens/s. The full table is
    ``comparison_table`` (``thresher compare``, the flow run's summary, MLflow)."""
    base = reference_record(records)
    paired = paired_deltas(records)
    tasks = sorted({k for r in records for k in r.tasks})
    speed = sorted(k for r in records for k in r.validation if k.startswith("throughput_c"))
    speed_key = max(speed, key=lambda k: int(k.removeprefix("throughput_c").removesuffix(
        "_tok_s")), default=None)
    accept = int(any(DRAFT_ACCEPTANCE in r.validation for r in records))
    rows: list[list[str]] = []
    for r in records:
        cells = [r.name, _fmt(_mb(r.size_bytes), 2), _fmt(r.bits_per_param, 2),
                 _fmt(r.perplexity, 2), _vs_base(base, r, r.perplexity, is_base=r is base)]
        for k in tasks:
            d = paired.get(r.name, {}).get(k)
            cells.append(_fmt(r.tasks.get(k)) + ("*" if d is not None and d.beyond_noise else ""))
        cells.append(_fmt(r.validation.get(speed_key) if speed_key else None, 0))
        rows.append(cells + ([_fmt(r.validation.get(DRAFT_ACCEPTANCE), 2)] if accept else []))
        for g in r.gguf_files():
            rows.append([f" └ {g.type}.gguf", _fmt(_mb(g.size_bytes), 2),
                         _fmt(g.bits_per_param, 2), _fmt(g.perplexity, 2),
                         _vs_base(base, r, g.perplexity, g.nll_key),
                         *["-"] * (len(tasks) + 1 + accept)])
    header = ["variant", "MB", "bits", "ppl", "ppl vs base (95% CI)",
              *[f"T{i + 1}" for i in range(len(tasks))], "tok/s", *["acc"] * accept]
    tail = 1 + accept  # tok/s (and acc) stay; task columns give way
    left = {0}  # the variant column reads from the left, the numbers from the right
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    spare = width - (sum(widths) + 2 * (len(widths) - 1))
    if spare < 0:  # long variant names give way first
        widths[0] = max(12, widths[0] + spare)
    cols = list(range(len(header)))
    while len(cols) > 5 + tail and sum(widths[c] for c in cols) + 2 * (len(cols) - 1) > width:
        cols.pop(-1 - tail)  # then the last task columns (still in the full table)

    def line(cells: list[str]) -> str:
        out = []
        for c in cols:
            text = cells[c] if len(cells[c]) <= widths[c] else cells[c][:widths[c] - 1] + "…"
            out.append(text.ljust(widths[c]) if c in left else text.rjust(widths[c]))
        return "  ".join(out)

    lines = [line(header), line(["-" * w for w in widths]), *(line(row) for row in rows), ""]
    ref = f"the base model ({base.name})" if base is not None else "none (no base row)"
    lines += [f"reference: {ref}", "ppl vs base: the perplexity change from the reference, "
              "95% interval paired over the evaluation windows (* beyond noise)"]
    kept = [tasks[c - 5] for c in cols[5:-tail]]
    for c in cols[5:-tail]:
        lines.append(f"{header[c]}: {tasks[c - 5]} (* differs from the reference beyond noise)")
    if len(kept) < len(tasks):
        lines.append(f"{len(tasks) - len(kept)} more task scores: in the full table "
                     "(`thresher compare`, the run's comparison.md)")
    if speed_key:
        level = speed_key.removeprefix("throughput_c").removesuffix("_tok_s")
        lines.append(f"tok/s: the serving engine's throughput at {level} concurrent requests")
    if accept:
        lines.append("acc: acceptance rate as a speculative-decoding draft of the base (greedy)")
    return "\n".join(line_.rstrip() for line_ in lines) + "\n"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def comparison_markdown(records: list[VariantRecord]) -> str:
    """The comparison table as markdown (the report's ``comparison.md``)."""
    return markdown_table(*comparison_table(records))


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
    paired_deltas: dict[str, Any] = field(default_factory=dict)


def build_report(records: Iterable[VariantRecord], out_dir: str | Path,
                 title: str = "thresher: variant comparison", task_metric: str = "acc") -> Report:
    """Write the table (markdown, HTML), the plots (PNG) and one self-contained report.html."""
    records = list(records)
    if not records:
        raise ArtifactError("comparison report: no variants to compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header, rows = comparison_table(records)
    files = {"table_md": out / COMPARISON_MD, "table_html": out / COMPARISON_HTML}
    files["table_md"].write_text(markdown_table(header, rows))
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
    deltas = paired_deltas_data(records)
    if deltas["metrics"]:
        files["paired_deltas"] = plot_paired_deltas(deltas, out / "paired_deltas.png")

    sections = [f"<h1>{html.escape(title)}</h1>", html_table(header, rows)]
    for key, caption in (("quality_vs_size", "Quality vs size (Pareto frontier in red)"),
                         ("task_scores", "Task scores"),
                         ("paired_deltas", "Task scores against the base, paired by document"),
                         ("saliency", "REAP saliency per layer and expert (x: removed)")):
        if key in files:
            png = base64.b64encode(files[key].read_bytes()).decode()
            sections.append(f"<h2>{caption}</h2><img alt='{key}' src='data:image/png;base64,{png}'>")
    files["html"] = out / REPORT_HTML
    files["html"].write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>"
                             f"{html.escape(title)}</title><style>{_CSS}</style></head><body>"
                             + "\n".join(sections) + "</body></html>\n")
    files["data"] = out / REPORT_DATA
    files["data"].write_text(json.dumps(
        {"quality_vs_size": panels, "task_bars": bars, "saliency": heat,
         "paired_deltas": deltas}, indent=1))
    log.info("comparison report for %d variants in %s", len(records), out)
    return Report(out_dir=out, files=files, header=header, rows=rows, quality_vs_size=panels,
                  task_bars=bars, saliency=heat, paired_deltas=deltas)


# --- MLflow --------------------------------------------------------------------------------------


def collect_from_mlflow(run_ids: list[str], tracking_uri: str | None = None) -> list[VariantRecord]:
    """Variant records from MLflow runs; a run with child runs (a flow's parent) expands to them."""
    tracker = Tracker(tracking_uri)
    return [record_from_run(tracker, run) for run_id in run_ids
            for run in tracker.variant_runs(run_id)]


def record_from_run(tracker: Tracker, run) -> VariantRecord:
    """The record of one variant's MLflow run."""
    tags = run.data.tags
    return VariantRecord.from_metrics(
        run.info.run_name or run.info.run_id, dict(run.data.metrics), dict(run.data.params),
        prune_report=tracker.find_json_artifact(run.info.run_id, PRUNE_REPORT),
        run_id=run.info.run_id, artifact=tags.get(ARTIFACT_DIR_TAG),
        model_uri=tags.get(MODEL_URI_TAG),
        task_samples=tracker.find_json_artifact(run.info.run_id, TASK_SAMPLES),
        window_nll=tracker.find_json_artifact(run.info.run_id, WINDOW_NLL))


def log_report(report: Report, run_id: str, tracking_uri: str | None = None,
               artifact_path: str = REPORT_ARTIFACT_PATH) -> None:
    """Attach the report's files to an MLflow run (the flow's parent run)."""
    tracker = Tracker(tracking_uri)
    for path in report.files.values():
        tracker.log_artifact(run_id, path, artifact_path)
