"""Greedy decoding of 4-bit tiny-demo artifacts on the CPU int4 path against the references.

Measured before asserting: RTN-4 g32, GPTQ-4 act-order g32 and AWQ-4 g32 each gave the same 32
greedy tokens on four prompts on both paths (fp32 engine; the int4 kernel computes in bf16).
"""

from __future__ import annotations

import pytest

from thresher import recipe
from thresher.compress.api import quantize_model
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams

CAL = CalibrationConfig(source=FilesSource(files=[recipe.__file__]), samples=2, seq_len=16)
PROMPTS = [[5, 17, 300, 42, 9, 77], [1023, 4000, 12, 3, 250], [61, 8, 99, 1500, 31, 7, 2, 640]]


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="rtn", group_size=32),
    QuantizeStage(method="gptq", group_size=32, act_order=True),
    QuantizeStage(method="awq", group_size=32),
], ids=["rtn", "gptq-act-order", "awq"])
def test_int4_fast_path_greedy_tokens_match_reference(stage, tiny_demo, tmp_path, monkeypatch):
    quantize_model(tiny_demo, stage, CAL, tmp_path / "q", show_progress=False)
    llm = LLM(tmp_path / "q")
    model = llm.engine.runner.model
    assert all(layer.mlp.experts.cpu_packs for layer in model.layers)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = [o.token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.setenv("THRESHER_KERNELS", "torch")
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == fast
