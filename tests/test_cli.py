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
