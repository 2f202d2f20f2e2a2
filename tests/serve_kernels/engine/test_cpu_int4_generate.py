"""Greedy decoding of 4-bit tiny-demo artifacts on the CPU int4 paths against the references.

torch's int4 kernel computes in bf16 and thresher's cpu_q4 on int8-rounded activations, the
reference in fp32 from the same codes, so they agree up to that rounding: RTN-4 g32, GPTQ-4 act-order g32 and AWQ-4 g32 usually give the same greedy
tokens on both paths, but a near-tie can flip (an artifact calibrated on other text once flipped
the first token of a prompt whose two best logits were that close). So the fast path's greedy
continuation is teacher-forced through the reference: its logits must stay within a small
fraction of their scale, and every token the fast path chose must be the reference's best or
within a near-tie margin of it.
"""

from __future__ import annotations

import json.decoder

import pytest

from tests.serve_kernels.conftest import assert_tracks_reference, prompt_pass
from thresher.compress.api import quantize_model
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.kernels import cpu_native

# a file outside this repository, so that editing thresher does not change the artifacts
CAL = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=2, seq_len=16)
PROMPTS = [[5, 17, 300, 42, 9, 77], [1023, 4000, 12, 3, 250], [61, 8, 99, 1500, 31, 7, 2, 640]]


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="rtn", group_size=32),
    QuantizeStage(method="gptq", group_size=32, act_order=True),
    QuantizeStage(method="awq", group_size=32),
], ids=["rtn", "gptq-act-order", "awq"])
@pytest.mark.parametrize("kernel", ["q4", "torch"])
def test_int4_fast_path_greedy_tokens_match_reference(stage, kernel, tiny_demo, tmp_path,
                                                      monkeypatch):
    if kernel == "q4" and cpu_native.library() is None:
        pytest.skip("no C compiler here, or no AVX2 and FMA")
    quantize_model(tiny_demo, stage, CAL, tmp_path / "q", show_progress=False)
    if kernel == "torch":
        monkeypatch.setenv(cpu_native.ENV, "off")
    llm = LLM(tmp_path / "q")
    model = llm.engine.runner.model
    assert all(layer.mlp.experts.cpu_packs for layer in model.layers)
    assert {p.kernel for layer in model.layers for p in layer.mlp.experts.cpu_packs} == {kernel}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = [o.token_ids for o in llm.generate(PROMPTS, params)]
    fast_passes = [prompt_pass(llm, p + f) for p, f in zip(PROMPTS, fast, strict=True)]
    monkeypatch.setenv("THRESHER_KERNELS", "torch")
    assert_tracks_reference(llm, PROMPTS, fast, fast_passes)
