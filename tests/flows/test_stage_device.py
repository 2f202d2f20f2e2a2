"""The flow's stage task computes on the recipe's execution device, which is not in its key."""

import json
from pathlib import Path

from tests.conftest import CALIBRATION_FILE
from thresher.flows.stages import run_stage
from thresher.formats.artifact import QUANTIZE_REPORT
from thresher.models.source import hash_directory
from thresher.recipe import CalibrationConfig, ExecutionConfig, FilesSource, Stage


def test_stage_runs_on_the_execution_device_and_keeps_its_key(tiny_demo, tmp_path):
    # calibrated, but cheap: attention kept in 16 bits, every expert falls back to RTN
    stage = Stage.model_validate({"quantize": {
        "method": "gptq", "bits": 4, "group_size": 32, "min_expert_tokens": 10**9,
        "keep_16bit": ["router", "embeddings", "lm_head", "attention"]}})
    cal = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)
    args = (str(tiny_demo), hash_directory(tiny_demo), stage, cal, str(tmp_path / "store"))
    first = run_stage.fn(*args, label="a",
                         execution=ExecutionConfig(device="cpu", offload_budget_gb=0))
    assert not first["cache_hit"]
    report = json.loads((Path(first["path"]) / QUANTIZE_REPORT).read_text())
    assert report["device"] == "cpu" and report["offloaded_batches"] == 1
    again = run_stage.fn(*args, label="b", execution=ExecutionConfig(device="auto"))
    assert again["cache_hit"] and again["key"] == first["key"]
