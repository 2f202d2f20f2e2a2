"""`thresher prune` on a saved random-init MoE."""

import json

from typer.testing import CliRunner

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.cli import app
from thresher.models import save_model

runner = CliRunner()


def test_prune_command_writes_checkpoint_and_report(tmp_path, tiny_tokenizer):
    save_model(build_random_model("qwen2_moe", vocab_size=len(tiny_tokenizer)), tiny_tokenizer,
               tmp_path / "base")
    out = tmp_path / "pruned"
    result = runner.invoke(app, ["prune", "--model", str(tmp_path / "base"), "--method", "frequency",
                                 "--ratio", "0.25", "--calibration", CALIBRATION_FILE,
                                 "--samples", "3", "--seq-len", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "prune_report.json").read_text())
    assert report["method"] == "frequency" and report["experts_kept"] == 6
    assert report["calibration_samples"] == 3
    assert json.loads((out / "config.json").read_text())["num_experts"] == 6
    assert "removed experts" in result.output


def test_prune_command_reports_bad_options_without_traceback(tmp_path):
    save_model(build_random_model("llama", num_layers=1), None, tmp_path / "dense")
    for args, message in (
        (["--ratio", "1.5"], "ratio must be in (0, 1)"),
        (["--method", "magnitude"], "--method"),
        (["--ratio", "0.5"], "dense model"),
    ):
        result = runner.invoke(app, ["prune", "--model", str(tmp_path / "dense"),
                                     "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_prune_command_device_option(tmp_path, tiny_tokenizer):
    result = runner.invoke(app, ["prune", "--help"])
    assert "--device" in result.output and "--offload-budget-gb" in result.output
    assert "cuda:N" in result.output
    save_model(build_random_model("qwen3_moe", vocab_size=len(tiny_tokenizer)), tiny_tokenizer,
               tmp_path / "base")
    args = ["prune", "--model", str(tmp_path / "base"), "--ratio", "0.25", "--calibration",
            CALIBRATION_FILE, "--samples", "3", "--seq-len", "16"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "p"), "--device", "cpu",
                                 "--offload-budget-gb", "0"])
    assert result.exit_code == 0, result.output
    assert "on cpu" in result.output
    assert json.loads((tmp_path / "p" / "prune_report.json").read_text())["device"] == "cpu"
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "q"), "--device", "tpu"])
    assert result.exit_code == 2 and "device 'tpu'" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()


def test_prune_command_refit(tmp_path, tiny_tokenizer):
    save_model(build_random_model("qwen3_moe", vocab_size=len(tiny_tokenizer)), tiny_tokenizer,
               tmp_path / "base")
    result = runner.invoke(app, ["prune", "--model", str(tmp_path / "base"), "--ratio", "0.5",
                                 "--calibration", CALIBRATION_FILE, "--samples", "3",
                                 "--seq-len", "16", "--refit", "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert "the refit left" in result.output
    report = json.loads((tmp_path / "p" / "prune_report.json").read_text())
    assert report["refit"] is True and report["metrics"]["refit_error_left"] < 1
    damped = runner.invoke(app, ["prune", "--model", str(tmp_path / "base"), "--ratio", "0.5",
                                 "--calibration", CALIBRATION_FILE, "--samples", "3",
                                 "--seq-len", "16", "--refit", "--refit-damp", "1e6",
                                 "--out", str(tmp_path / "d")])
    assert damped.exit_code == 0, damped.output
    # a huge ridge keeps the original weights: almost none of the error is removed
    left = json.loads((tmp_path / "d" / "prune_report.json").read_text())["metrics"]
    assert left["refit_error_left"] > 0.99 > report["metrics"]["refit_error_left"]
    alone = runner.invoke(app, ["prune", "--model", str(tmp_path / "base"), "--refit-damp", "0.1",
                                "--out", str(tmp_path / "e")])
    assert alone.exit_code != 0 and "add --refit" in alone.output
    assert not (tmp_path / "e").exists()
