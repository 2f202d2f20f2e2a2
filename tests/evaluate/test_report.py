"""The comparison report: table, plots (checked through their data), MLflow round trip."""

from __future__ import annotations

import json
import math

import pytest

from thresher.errors import ArtifactError
from thresher.evaluate.report import (
    LayerSaliency,
    VariantRecord,
    build_report,
    collect_from_mlflow,
    log_report,
    pareto_front,
    parse_prune_report,
)


def _records() -> list[VariantRecord]:
    saliency = [LayerSaliency(i, [0.1 * (e + 1) + i for e in range(8)], [0, 1, 2, 3])
                for i in range(4)]
    return [
        VariantRecord("base", size_bytes=6.0e6, bits_per_param=32, perplexity=150.0,
                      tasks={"stdlib_next_line/acc": 0.62, "stdlib_identifier/acc": 0.55},
                      task_stderr={"stdlib_next_line/acc": 0.028}),
        VariantRecord("reap50", size_bytes=3.5e6, bits_per_param=32, perplexity=180.0,
                      experts_kept=4, stages="prune reap ratio=0.5",
                      tasks={"stdlib_next_line/acc": 0.50, "stdlib_identifier/acc": 0.45},
                      saliency=saliency),
        # bigger and worse than reap50 on both measures: off the frontier
        VariantRecord("bad", size_bytes=4.0e6, bits_per_param=16, perplexity=400.0,
                      tasks={"stdlib_next_line/acc": 0.30, "stdlib_identifier/acc": 0.28}),
        VariantRecord("gptq4", size_bytes=1.2e6, bits_per_param=4.2, perplexity=170.0,
                      tasks={"stdlib_next_line/acc": 0.58}, throughput_tok_s=812.5,
                      validation={"agreement": 0.9, "throughput_c4_tok_s": 812.5,
                                  "ttft_p50_ms_c1": 12.0, "draft_acceptance_rate": 0.7234,
                                  "speculative_tokens_per_s": 412.5,
                                  "speculative_speedup": 0.51}),
    ]


def test_pareto_front():
    points = [("a", 1.0, 10.0), ("b", 2.0, 5.0), ("c", 3.0, 6.0), ("d", 2.0, 5.0), ("e", 0.5, 20)]
    assert pareto_front(points, lower_is_better=True) == ["e", "a", "b", "d"]
    assert pareto_front(points, lower_is_better=False) == ["e"]  # smallest and best
    assert pareto_front(points[1:4], lower_is_better=False) == ["b", "d", "c"]


def test_report_files_and_plot_data(tmp_path):
    records = _records()
    report = build_report(records, tmp_path / "out")
    for key in ("table_md", "table_html", "quality_vs_size", "task_scores", "saliency", "html",
                "data"):
        assert report.files[key].is_file() and report.files[key].stat().st_size > 0, key
    assert report.files["quality_vs_size"].read_bytes()[:4] == b"\x89PNG"

    ppl, acc = report.quality_vs_size
    assert ppl["metric"] == "perplexity" and ppl["lower_is_better"]
    assert sorted(n for n, _, _ in ppl["points"]) == sorted(r.name for r in records)
    assert ppl["frontier"] == ["gptq4", "base"]  # bad is dominated by reap50; reap50 by gptq4
    assert acc["frontier"] == ["gptq4", "base"]
    acc_by_name = {n: y for n, _, y in acc["points"]}
    assert math.isclose(acc_by_name["base"], (0.62 + 0.55) / 2)
    assert math.isclose(acc_by_name["gptq4"], 0.58)  # mean over the tasks it has

    bars = report.task_bars
    assert bars["variants"] == ["base", "reap50", "bad", "gptq4"]
    assert bars["tasks"] == ["stdlib_identifier/acc", "stdlib_next_line/acc"]
    assert bars["values"][1] == [0.62, 0.50, 0.30, 0.58]
    assert math.isnan(bars["values"][0][3])

    heat = report.saliency
    assert list(heat) == ["reap50"]
    assert len(heat["reap50"]["matrix"]) == 4 and len(heat["reap50"]["matrix"][0]) == 8
    assert (2, 3) in heat["reap50"]["removed"] and len(heat["reap50"]["removed"]) == 16

    md = report.files["table_md"].read_text()
    for r in records:
        assert f"| {r.name} |" in md
    assert "0.620 ± 0.028" in md and "812.5" in md
    page = report.files["html"].read_text()
    assert page.count("data:image/png;base64,") == 3 and "<table>" in page
    assert json.loads(report.files["data"].read_text())["task_bars"]["variants"] == bars["variants"]


def test_report_without_tasks_or_sizes(tmp_path):
    report = build_report([VariantRecord("a", perplexity=10.0), VariantRecord("b", perplexity=9.0)],
                          tmp_path)
    assert "quality_vs_size" not in report.files and "task_scores" not in report.files
    assert report.files["html"].stat().st_size > 0
    with pytest.raises(ArtifactError):
        build_report([], tmp_path)


def test_metrics_round_trip():
    record = _records()[0]
    again = VariantRecord.from_metrics("ignored", record.metrics(), {"variant": "base"})
    assert again.name == "base"
    assert again.tasks == record.tasks and again.task_stderr == record.task_stderr
    assert again.perplexity == record.perplexity and again.size_bytes == record.size_bytes


def test_flow_result_round_trip():
    """The flow returns records as plain data; the CLI reads them back as the same records."""
    record = VariantRecord.from_metrics(
        "rtn4", {"perplexity": 12.5, "size_bytes": 3e6, "stage_cache_hits": 1.0,
                 "validate/agreement": 0.9, "validate/throughput_c4_tok_s": 120.0},
        {"variant": "rtn4", "stages": "quantize rtn 4-bit g64"}, run_id="r1",
        artifact="/pub/rtn4", model_uri="models:/ft-rtn4/1")
    data = record.to_dict()
    assert data["stage_cache_hits"] == 1.0 and data["validate/agreement"] == 0.9
    assert data["model_uri"] == "models:/ft-rtn4/1" and data["artifact"] == "/pub/rtn4"
    assert VariantRecord.from_dict(data) == record
    assert "model_uri" not in VariantRecord("base", stages="base").to_dict()


def test_bad_prune_report_is_refused():
    with pytest.raises(ArtifactError, match="prune_report.json"):
        parse_prune_report({"layers": [{"layer": 0, "saliency": [1.0]}]})


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("compare-test")
    yield uri
    mlflow.set_tracking_uri(None)


def test_collect_from_mlflow_and_log(tmp_path, mlflow_store):
    """A flow-shaped run tree (parent + one run per variant) -> records -> report -> parent run."""
    import mlflow
    from mlflow.tracking import MlflowClient

    records = _records()
    with mlflow.start_run(run_name="flow") as parent:
        for r in records:
            with mlflow.start_run(run_name=r.name, nested=True):
                mlflow.log_params({"variant": r.name, "stages": r.stages or "base"})
                mlflow.log_metrics(r.metrics())
                if r.saliency:
                    prune = {"layers": [{"layer": s.layer, "saliency": s.saliency,
                                         "removed": s.removed} for s in r.saliency]}
                    mlflow.log_dict(prune, "prune_report.json")
    got = collect_from_mlflow([parent.info.run_id], tracking_uri=mlflow_store)
    assert [g.name for g in got] == [r.name for r in records]
    by_name = {g.name: g for g in got}
    assert by_name["reap50"].saliency == records[1].saliency
    assert by_name["base"].saliency is None
    assert by_name["gptq4"].throughput_tok_s == 812.5
    assert by_name["base"].tasks == records[0].tasks

    report = build_report(got, tmp_path / "report")
    log_report(report, parent.info.run_id, tracking_uri=mlflow_store)
    logged = {a.path for a in MlflowClient(mlflow_store).list_artifacts(parent.info.run_id,
                                                                         "comparison")}
    assert {"comparison/report.html", "comparison/quality_vs_size.png",
            "comparison/saliency.png"} <= logged

    # the CLI: `thresher compare PARENT --out DIR --log-to PARENT`
    from typer.testing import CliRunner

    from thresher.cli import app

    result = CliRunner().invoke(app, ["compare", parent.info.run_id, "--out", str(tmp_path / "cli"),
                                      "--tracking-uri", mlflow_store, "--log-to", by_name["base"].run_id])
    assert result.exit_code == 0, result.output
    assert "| reap50 |" in (tmp_path / "cli" / "comparison.md").read_text()
    # speculative decoding's columns: the variant as a draft of the base
    table = (tmp_path / "cli" / "comparison.md").read_text().splitlines()
    assert "| acceptance as draft | speculative tok/s (base, this draft) |" in table[0]
    assert next(r for r in table if r.startswith("| gptq4 |")).endswith(
        "| 0.723 | 412.5 (0.51x) |")
    assert "0.723" in result.output and "412.5" in result.output
    assert (tmp_path / "cli" / "report.html").stat().st_size > 0 and "variants" in result.output
    assert any(a.path == "comparison/comparison.md" for a in MlflowClient(mlflow_store)
               .list_artifacts(by_name["base"].run_id, "comparison"))

    # single variant runs are taken as they are
    one = collect_from_mlflow([by_name["bad"].run_id], tracking_uri=mlflow_store)
    assert [r.name for r in one] == ["bad"]
    with pytest.raises(ArtifactError, match="not found"):
        collect_from_mlflow(["0" * 32], tracking_uri=mlflow_store)
