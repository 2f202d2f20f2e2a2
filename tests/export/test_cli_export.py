"""`thresher export gguf` on the tiny demo model."""

import gguf
import pytest
from typer.testing import CliRunner

from thresher.cli import app
from thresher.export import GGUF_TYPES

runner = CliRunner()


def test_export_gguf_command_writes_the_file(tiny_demo, tmp_path):
    out = tmp_path / "tiny.gguf"
    result = runner.invoke(app, ["export", "gguf", str(tiny_demo), "--type", "q8_0",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "qwen3moe q8_0: 50 tensors, 8 experts per layer" in result.output
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F32"}


def test_export_gguf_command_reports_errors_without_traceback(tiny_demo, tmp_path):
    result = runner.invoke(app, ["export", "gguf", str(tiny_demo), "--type", "q2_k",
                                 "--out", str(tmp_path / "x.gguf")])
    assert result.exit_code == 2, result.output
    assert "q2_k" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.gguf").exists()


def test_export_gguf_help_names_every_type():
    result = runner.invoke(app, ["export", "gguf", "--help"])
    assert result.exit_code == 0
    assert all(t in result.output for t in GGUF_TYPES) and "--out" in result.output


@pytest.mark.slow
def test_export_gguf_command_rounds_by_gptq(tiny_demo, tmp_path):
    out = tmp_path / "tiny.gguf"
    result = runner.invoke(app, ["export", "gguf", str(tiny_demo), "--type", "q4_0", "--gptq",
                                 "--calibration-samples", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "qwen3moe q4_0 rounded by GPTQ: 50 tensors" in result.output
    reader = gguf.GGUFReader(out)
    assert reader.fields[gguf.Keys.IMatrix.CHUNK_COUNT].contents() == 2
