from pathlib import Path

from typer.testing import CliRunner

from thresher.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_help_explains_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("check", "demo", "perplexity", "demo-model"):
        assert command in result.output


def test_check_prints_plan():
    result = runner.invoke(app, ["check", str(ROOT / "configs" / "demo.yaml")])
    assert result.exit_code == 0, result.output
    assert "recipe is valid" in result.output
    assert "prune auto ratio=0.5" in result.output


def test_check_reports_field_without_traceback(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nmodel: demo:tiny\nvariants:\n  - name: a\n    stages:\n"
                   "      - quantize: {method: gptq, bits: 7}\n")
    result = runner.invoke(app, ["check", str(bad)])
    assert result.exit_code == 2
    assert "variants.0.stages.0.quantize.bits" in result.output
    assert "Traceback" not in result.output


def test_run_summary_prints_the_compact_table_and_where_the_full_one_is(tmp_path):
    from thresher.cli import console, print_summary_table
    from thresher.evaluate.report import VariantRecord

    records = [VariantRecord.from_metrics(n, {"size_bytes": 4e6, "perplexity": p},
                                          {"variant": n, "stages": s})
               for n, s, p in (("base", "base", 10.0), ("awq4", "quantize awq 4-bit g64", 11.0))]
    records[0].window_nll = {"perplexity": [2.0, 2.4, 2.2, 2.3]}
    records[1].window_nll = {"perplexity": [2.1, 2.5, 2.3, 2.4]}
    with console.capture() as out:
        print_summary_table({"variants": [r.to_dict() for r in records],
                             "report_dir": str(tmp_path)})
    text = out.get()
    table, where = text.split("full table: ")
    assert max(len(line) for line in table.splitlines()) <= 120
    assert "reference" in table and "+10.52% [+10.52, +10.52]*" in table
    assert where.startswith(str(tmp_path / "comparison.md"))
