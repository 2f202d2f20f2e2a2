"""demo:fine, the fine-grained demo model: its spec, and its architecture built for a few steps
(the suite never trains the real one) through the CLI, then merged and served."""

from __future__ import annotations

import dataclasses
import json.decoder

import torch
from typer.testing import CliRunner

from thresher.cli import app
from thresher.data import demo_model
from thresher.models import get_adapter, load_model
from thresher.models.layerwise import load_config
from thresher.prune.merge_api import merge_model
from thresher.recipe import CalibrationConfig, FilesSource, MergeStage
from thresher.serve_kernels import LLM, SamplingParams


def test_fine_is_fine_grained_with_smalls_active_width():
    fine, small = demo_model.SPECS["fine"], demo_model.SPECS["small"]
    assert fine.num_experts >= 64 and fine.top_k == 8
    assert fine.top_k * fine.moe_intermediate_size == small.top_k * small.moe_intermediate_size
    assert demo_model.demo_model_dir("fine").name.startswith("fine-")
    help_text = CliRunner().invoke(app, ["demo-model", "build", "--help"]).output
    assert "fine (64 experts, top-8" in " ".join(help_text.split())


def test_fine_architecture_builds_through_the_cli_merges_and_serves(tmp_path, monkeypatch):
    monkeypatch.setenv("THRESHER_HOME", str(tmp_path))
    monkeypatch.setenv("THRESHER_DEMO_MODELS", str(tmp_path / "demo-models"))  # not the cache
    monkeypatch.setitem(demo_model.SPECS, "fine",
                        dataclasses.replace(demo_model.SPECS["fine"], steps=2))
    result = CliRunner().invoke(app, ["demo-model", "build", "fine"])
    assert result.exit_code == 0, result.output
    path = demo_model.demo_model_dir("fine")
    assert "trained 2 steps" in result.output and str(path) in result.output.replace("\n", "")
    config = load_config(path)
    assert get_adapter(config).num_experts(config) == 64 and config.num_experts_per_tok == 8
    cal = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=4,
                            seq_len=32)
    out = tmp_path / "merged"
    report = merge_model(path, MergeStage(method="m_smoe", ratio=0.5), cal, out,
                         show_progress=False)
    assert [len(layer.groups) for layer in report.layers] == [32] * 4
    merged = load_model(out)
    prompt = [5, 17, 300, 42, 9, 77]
    with torch.no_grad():
        want = merged.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6,
                               do_sample=False)[0, len(prompt):].tolist()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert LLM(out).generate([prompt], greedy)[0].token_ids == want
