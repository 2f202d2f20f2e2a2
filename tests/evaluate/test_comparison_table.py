"""The comparison table: validation columns appear when the variants were validated."""

from __future__ import annotations

import re

import pytest

from thresher.errors import EvaluationError
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


def drafted(acceptance: float, tok_s: float, speedup: float,
            prefix: str = "validate/") -> dict:
    return {f"{prefix}draft_acceptance_rate": acceptance,
            f"{prefix}draft_mean_accepted_length": 1 + 4 * acceptance,
            f"{prefix}speculative_tokens_per_s": tok_s, f"{prefix}speculative_speedup": speedup}


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


def test_speculative_columns_appear_where_a_variant_was_scored_as_a_draft():
    """Acceptance as a draft of the base and the base's speculative tokens/s (with the ratio to
    plain decoding), and a variant served with its own draft, each only when measured."""
    base = row("base", "base", 10.0, **validated(1.0, 300.0, 40.0))
    gptq = row("gptq4", "quantize gptq 4-bit g128", 10.5, **validated(0.8, 250.0, 55.0),
               **drafted(0.7234, 412.5, 1.375))
    assert list(validation_columns([base, row("nf4", "quantize nf4", 11.0,
                                              **validated(0.7, 200.0, 60.0))])) == [
        "agreement", "tok/s @c16", "TTFT p50 ms @c1"]
    cols = validation_columns([base, gptq])
    assert cols["acceptance as draft"] == ["-", "0.723"]
    assert cols["speculative tok/s (base, this draft)"] == ["-", "412.5 (1.38x)"]
    assert "with its draft: acceptance" not in cols
    served = row("p50", "prune reap ratio=0.5", 12.0, **validated(0.6, 280.0, 50.0),
                 **drafted(0.5, 90.0, 0.8, prefix="validate/with_draft/"))
    cols = validation_columns([base, gptq, served])
    assert cols["with its draft: acceptance"] == ["-", "-", "0.500"]
    assert cols["with its draft: speculative tok/s"] == ["-", "-", "90.0 (0.80x)"]
    header = comparison_markdown([base, gptq, served]).splitlines()[0]
    assert header.endswith("| acceptance as draft | speculative tok/s (base, this draft) | "
                           "with its draft: acceptance | with its draft: speculative tok/s |")


def test_no_validation_no_columns():
    rows = [row("base", "base", 10.0), row("p25", "prune frequency ratio=0.25", 12.0)]
    assert validation_columns(rows) == {}
    assert comparison_markdown(rows).splitlines()[0].endswith("| perplexity | vs base (95% CI) |")


def test_task_cells_show_the_paired_difference_from_the_base(tmp_path):
    """Same documents, matched by key: a consistent drop is starred, the same scores listed in
    another order are no difference, a reshuffle of the same mean is not beyond noise; a variant
    scored on other documents is refused by name."""
    base_docs = {f"d{i}": float(i % 2 == 0) for i in range(200)}
    keys = list(base_docs)
    records = [row("base", "base", 10.0, **{"task/t/acc": 0.5}),
               row("worse", "prune reap ratio=0.5", 12.0, **{"task/t/acc": 0.3}),
               row("same", "quantize rtn 4-bit g128", 10.1, **{"task/t/acc": 0.5}),
               row("shuffled", "quantize nf4", 10.2, **{"task/t/acc": 0.5})]
    records[0].task_samples = {"t/acc": base_docs}
    records[1].task_samples = {"t/acc": {k: 0.0 if i % 10 < 3 else base_docs[k]
                                         for i, k in enumerate(keys)}}
    records[2].task_samples = {"t/acc": dict(reversed(list(base_docs.items())))}
    records[3].task_samples = {"t/acc": {k: base_docs[keys[(i + 1) % 200]]
                                         for i, k in enumerate(keys)}}
    cells = [line.split(" | ")[-1].rstrip(" |")
             for line in comparison_markdown(records).splitlines()[2:]]
    assert cells[0] == "0.500"
    assert cells[1].startswith("0.300, Δ -0.200 [") and cells[1].endswith("] *")
    assert cells[2] == "0.500, Δ +0.000 [+0.000, +0.000]"
    assert cells[3].startswith("0.500, Δ +0.000 [-") and not cells[3].endswith("*")
    report = build_report(records, tmp_path)
    deltas = report.paired_deltas
    assert deltas["metrics"] == ["t/acc"] and deltas["variants"] == ["worse", "same", "shuffled"]
    assert [p["beyond_noise"] for p in deltas["points"][0]] == [True, False, False]
    assert report.files["paired_deltas"].stat().st_size > 0
    assert "paired by document" in report.files["html"].read_text()
    records[3].task_samples = {"t/acc": dict(list(base_docs.items())[:50])}
    with pytest.raises(EvaluationError, match=r"shuffled t/acc: .*different documents"):
        comparison_markdown(records)


def _windows(shift: float, n: int = 64) -> list[float]:
    """Per-window NLLs: the base's pattern moved by ``shift`` nats, with a little noise."""
    return [3.0 + 0.2 * ((i * 7) % 5) + shift + 0.001 * ((i * 13) % 3) for i in range(n)]


@pytest.mark.parametrize("drafts", [False, True])
def test_demo_recipe_terminal_table_fits_120_columns(drafts):
    """Every variant of the demo recipe on one line each, task names in the key, the base row
    marked as the reference and every other row's perplexity change with its interval; with the
    variants scored as drafts of the base, their acceptance rate in a last column."""
    from thresher.cli import DEMO_RECIPE
    from thresher.evaluate.report import terminal_table
    from thresher.recipe import load_recipe

    demo = load_recipe(DEMO_RECIPE)
    metrics = [f"{t}/{m}" for t in demo.eval.tasks for m in ("exact_match", "char_similarity")]
    records = []
    for i, v in enumerate(demo.variants):
        stages = " -> ".join(s.describe() for s in v.stages) or "base"
        extra = {f"task/{k}": 0.4 - 0.01 * i for k in metrics}
        extra.update({f"task/{k}_stderr": 0.02 for k in metrics})
        extra.update(validated(0.9, 300.0 - i, 40.0))
        if drafts and v.stages:
            extra.update(drafted(0.61 + 0.01 * i, 150.0, 0.5))
        r = row(v.name, stages, 10.0 + i, **extra)
        r.window_nll = {"perplexity": _windows(0.01 * i)}
        records.append(r)
    text = terminal_table(records)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120, text
    table = lines[2:2 + len(records)]
    for line, v in zip(table, demo.variants, strict=True):
        assert line.startswith(v.name + " ")
    assert "reference" in table[0]
    assert all(re.search(r"\+\d+\.\d\d% \[\+\d+\.\d\d, \+\d+\.\d\d\]\*", line)
               for line in table[1:]), text
    for i, k in enumerate(sorted(metrics)):
        assert f"T{i + 1}: {k}" in text
    assert "reference: the base model (base)" in text
    assert re.search(r"tok/s +acc$" if drafts else r"tok/s$", lines[0]), lines[0]
    assert ("acc: acceptance rate as a speculative-decoding draft" in text) == drafts
    if drafts:
        assert table[0].endswith("-") and table[1].endswith("0.62") and table[7].endswith("0.68")


def test_gguf_rows_and_a_reference_from_windows():
    """A variant's evaluated GGUF file gets its own row with its change from the base."""
    from thresher.evaluate.report import comparison_table, terminal_table

    base = row("base", "base", 20.0)
    base.window_nll = {"perplexity": _windows(0.0)}
    awq = row("awq4", "quantize awq 4-bit g64", 21.0, parameters=1e6,
              **{"gguf/q4_k_m/perplexity": 22.0, "gguf/q4_k_m/size_bytes": 7e5,
                 "gguf/q4_k_m/requantized": 1.0})
    awq.window_nll = {"perplexity": _windows(0.05), "gguf/q4_k_m": _windows(0.1)}
    header, rows = comparison_table([base, awq])
    assert [r[0] for r in rows] == ["base", "awq4", "awq4-q4_k_m.gguf"]
    assert rows[0][header.index("vs base (95% CI)")] == "reference"
    gguf_row = rows[2]
    assert gguf_row[1] == "GGUF q4_k_m (requantized: second rounding)"
    assert gguf_row[header.index("bits/param")] == "5.60"
    assert gguf_row[header.index("vs base (95% CI)")].startswith("+10.52% [+10.")
    text = terminal_table([base, awq])
    assert " └ q4_k_m.gguf" in text and "22.00" in text
