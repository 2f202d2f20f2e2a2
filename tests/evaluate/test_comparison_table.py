"""The comparison table: validation columns appear when the variants were validated."""

from __future__ import annotations

from thresher.evaluate.report import (
    VariantRecord,
    build_report,
    comparison_markdown,
    validation_columns,
)


def row(name: str, stages: str, ppl: float, **extra: float) -> VariantRecord:
    return VariantRecord.from_metrics(name, {"size_bytes": 4e6, "bits_per_param": 4.5,
                                             "experts_kept": 8.0, "perplexity": ppl, **extra},
                                      {"variant": name, "stages": stages})


def validated(agreement: float, tok_s: float, ttft: float) -> dict:
    return {"validate/agreement": agreement, "validate/throughput_c1_tok_s": tok_s / 3,
            "validate/throughput_c16_tok_s": tok_s, "validate/ttft_p50_ms_c1": ttft,
            "validate/ttft_p50_ms_c16": ttft * 5}


def test_validation_columns_pick_highest_throughput_and_lowest_ttft():
    rows = [row("base", "base", 10.0, **validated(1.0, 300.0, 40.0)),
            row("gptq4", "quantize gptq 4-bit g128", 10.5, **validated(0.8125, 250.0, 55.0))]
    cols = validation_columns(rows)
    assert cols == {"agreement": ["1.000", "0.812"], "tok/s @c16": ["300.0", "250.0"],
                    "TTFT p50 ms @c1": ["40", "55"]}
    lines = comparison_markdown(rows).splitlines()
    assert lines[0].endswith("| agreement | tok/s @c16 | TTFT p50 ms @c1 |")
    assert lines[1].count("---") == 10
    assert lines[3].endswith("| +5.00% | 0.812 | 250.0 | 55 |")


def test_no_validation_no_columns():
    rows = [row("base", "base", 10.0), row("p25", "prune frequency ratio=0.25", 12.0)]
    assert validation_columns(rows) == {}
    assert comparison_markdown(rows).splitlines()[0].endswith("| perplexity | vs base |")


def test_task_cells_show_the_paired_difference_from_the_base(tmp_path):
    """Same documents: a consistent drop is starred, a reshuffle of the same mean is not; a
    variant scored on other documents (another limit) gets no interval."""
    base_docs = [1.0, 0.0] * 100
    records = [row("base", "base", 10.0, **{"task/t/acc": 0.5}),
               row("worse", "prune reap ratio=0.5", 12.0, **{"task/t/acc": 0.3}),
               row("same", "quantize rtn 4-bit g128", 10.1, **{"task/t/acc": 0.5}),
               row("other", "quantize nf4", 10.2, **{"task/t/acc": 0.5})]
    records[0].task_samples = {"t/acc": base_docs}
    records[1].task_samples = {"t/acc": [0.0 if i % 10 < 3 else s
                                         for i, s in enumerate(base_docs)]}
    records[2].task_samples = {"t/acc": base_docs[1:] + base_docs[:1]}
    records[3].task_samples = {"t/acc": base_docs[:50]}
    cells = [line.split(" | ")[-1].rstrip(" |")
             for line in comparison_markdown(records).splitlines()[2:]]
    assert cells[0] == "0.500"
    assert cells[1].startswith("0.300, Δ -0.200 [") and cells[1].endswith("] *")
    assert cells[2].startswith("0.500, Δ +0.000 [-") and not cells[2].endswith("*")
    assert cells[3] == "0.500"
    report = build_report(records, tmp_path)
    deltas = report.paired_deltas
    assert deltas["metrics"] == ["t/acc"] and deltas["variants"] == ["worse", "same"]
    assert [p["beyond_noise"] for p in deltas["points"][0]] == [True, False]
    assert report.files["paired_deltas"].stat().st_size > 0
    assert "paired by document" in report.files["html"].read_text()
