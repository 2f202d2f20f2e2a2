"""`thresher quantize` writes an artifact and reports bad options without a traceback."""

import json

import pytest
import torch
from typer.testing import CliRunner

from thresher.cli import app


def test_quantize_command_writes_an_artifact(tiny_demo, tmp_path):
    out = tmp_path / "rtn"
    result = CliRunner().invoke(app, ["quantize", "--model", str(tiny_demo), "--method", "rtn",
                                      "--bits", "4", "--group-size", "64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "gptq format" in result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4
    assert "note:" not in result.output  # a standard checkpoint


def test_quantize_command_says_a_damage_budget_artifact_runs_in_thresher_only(tiny_damage_pruned,
                                                                              tmp_path):
    path, counts = tiny_damage_pruned
    result = CliRunner().invoke(app, ["quantize", "--model", str(path), "--method", "rtn",
                                      "--group-size", "64", "--out", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # rich wraps long lines
    assert f"layer_num_experts {counts}" in output and "vLLM" in output


def test_quantize_command_refuses_bad_options(tiny_demo, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["quantize", "--model", str(tiny_demo), "--method", "gptq",
                                 "--group-size", "128", "--samples", "2", "--out",
                                 str(tmp_path / "g")])
    assert result.exit_code == 2
    assert "does not divide the 64 inputs" in result.output
    # the largest group size that fits every layer is named
    assert "group_size 64 divides every layer's input size, or -1" in " ".join(
        result.output.split())
    result = runner.invoke(app, ["quantize", "--model", str(tiny_demo), "--method", "nf4",
                                 "--bits", "3", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "4-bit" in result.output
    assert "Traceback" not in result.output and not list(tmp_path.iterdir())


def test_quantize_command_checks_bits_auto_options(tiny_demo, tmp_path):
    runner = CliRunner()
    base = ["quantize", "--model", str(tiny_demo), "--out", str(tmp_path / "a")]
    result = runner.invoke(app, [*base, "--bits", "auto"])
    assert result.exit_code == 2 and "exactly one of target_bits and target_mb" in result.output
    result = runner.invoke(app, [*base, "--method", "awq", "--bits", "auto", "--target-bits", "3"])
    assert result.exit_code == 2 and "--bits: 'auto'" in result.output
    result = runner.invoke(app, [*base, "--bits", "five"])
    assert result.exit_code == 2 and "--bits: Input should be 2, 3, 4, 8 or 'auto'" in result.output
    assert "Traceback" not in result.output and not list(tmp_path.iterdir())


def test_quantize_command_device_option(tiny_demo, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["quantize", "--help"])
    assert "--device" in result.output and "--offload-budget-gb" in result.output
    assert "cuda:N" in result.output
    if torch.cuda.is_available():
        pytest.skip("checks the error of a machine without CUDA")
    result = runner.invoke(app, ["quantize", "--model", str(tiny_demo), "--method", "rtn",
                                 "--group-size", "64", "--device", "cuda", "--out",
                                 str(tmp_path / "q")])
    assert result.exit_code == 2, result.output
    assert "no CUDA device is available" in result.output and "--device cpu" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()
