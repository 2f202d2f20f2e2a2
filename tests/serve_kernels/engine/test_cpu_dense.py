"""Small quantized matrices dequantized at load on the CPU (``kernels/cpu_dense.py``).

Under the default threshold every matrix of the demo models is small enough, so a 4-bit artifact
of `tiny` must serve every layer dense (no packed kernel left), run the same operators per decode
step as its 16-bit parent (the point of the path: on a dispatch-bound model a 4-bit variant costs
what the 16-bit one does), and give the dequantizing references' tokens and logits: both compute
in fp32 from the same codes, so only the summation order differs. The session pins the threshold
to 0 (tests/conftest.py) so the other tests keep the packed kernels; these tests unset it.
"""

from __future__ import annotations

import json.decoder

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.serve_kernels.conftest import prompt_logits
from tests.serve_kernels.kernels.helpers import random_gptq
from thresher.compress.api import quantize_model
from thresher.recipe import CalibrationConfig, FilesSource, NF4Stage, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.kernels import cpu_dense
from thresher.serve_kernels.kernels.cpu_int4 import default_kernel
from thresher.serve_kernels.kernels.w4a16 import gptq_matmul_ref
from thresher.serve_kernels.modeling.linear import (
    AWQLinear,
    ConcatLinear,
    GPTQLinear,
    NF4Linear,
    packed_bytes,
)
from thresher.serve_kernels.modeling.moe import ExpertLoop, FusedExperts

CAL = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=2, seq_len=16)
PROMPTS = [[5, 17, 300, 42, 9, 77], [1023, 4000, 12, 3, 250], [61, 8, 99, 1500, 31, 7, 2, 640]]
STAGES = {
    "gptq-act-order": QuantizeStage(method="gptq", group_size=32, act_order=True),
    "awq": QuantizeStage(method="awq", group_size=32),
    "nf4": NF4Stage(double_quant=True),
}
QUANTIZED = (GPTQLinear, AWQLinear, NF4Linear)


@pytest.fixture(scope="module")
def artifacts(tiny_demo, tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    for name, stage in STAGES.items():
        quantize_model(tiny_demo, stage, None if name == "nf4" else CAL, root / name,
                       show_progress=False)
    return root


@pytest.fixture
def default_threshold(monkeypatch):
    monkeypatch.delenv(cpu_dense.ENV_VAR, raising=False)


def _decode_ops(llm: LLM) -> dict[str, int]:
    """aten operator calls of one decode step at batch 1."""
    engine = llm.engine
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}


@pytest.mark.parametrize("name", list(STAGES))
def test_small_quantized_layers_serve_dense_like_the_reference(name, artifacts, default_threshold,
                                                               monkeypatch):
    llm = LLM(artifacts / name, dtype="float32")
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QUANTIZED)]
    outside = [m for m in quantized if not any(m in list(layer.mlp.experts.modules())
                                               for layer in model.layers)]
    assert outside and all(m.cpu_dense is not None and not m.cpu_packs for m in outside)
    for layer in model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, ExpertLoop if name == "nf4" else FusedExperts)
        if name == "gptq-act-order":  # static groups keep g_idx contiguous: a GPU loads rows
            assert experts.contiguous_groups == {"gate_up": 32, "down": 32}
        assert experts.cpu_dense is not None and not experts.cpu_packs
        qkv = layer.attn.qkv  # one dense matrix for q, k and v, even where they are kept apart
        dense = qkv.cpu_dense
        assert dense is not None and dense.shape == (qkv.out_features, qkv.in_features)
        assert dense.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = [o.token_ids for o in llm.generate(PROMPTS, params)]
    fast_logits = [prompt_logits(llm, p + f) for p, f in zip(PROMPTS, fast, strict=True)]
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the dequantizing references
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == fast
    for prompt, tokens, got in zip(PROMPTS, fast, fast_logits, strict=True):
        ref = prompt_logits(llm, prompt + tokens)
        assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def test_a_4bit_decode_step_runs_the_16bit_parents_operators(artifacts, tiny_demo,
                                                             default_threshold):
    base = _decode_ops(LLM(tiny_demo, dtype="float32"))
    for name in STAGES:
        ops = _decode_ops(LLM(artifacts / name, dtype="float32"))
        assert ops == base, name
    packed = _with_threshold(0, artifacts / "gptq-act-order")  # the threshold switches it
    packs = [p for m in packed.engine.runner.model.modules() for p in getattr(m, "cpu_packs", ())]
    assert packs and all(p.kernel == default_kernel() for p in packs)
    if default_kernel() == "torch":  # cpu_q4 is a ctypes call, not a torch operator
        assert _decode_ops(packed).get("aten::_weight_int4pack_mm_for_cpu", 0) > 0


def _with_threshold(value: int, path) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_dense.ENV_VAR, str(value))
        return LLM(path, dtype="float32")


def test_threshold_splits_by_matrix_size_and_serves_the_dtype(artifacts, default_threshold):
    path = artifacts / "awq"
    packed = _with_threshold(0, path).engine.runner.model
    assert all(m.cpu_dense is None for m in packed.modules() if isinstance(m, QUANTIZED))
    hidden = packed.spec.hidden_size
    # room for o_proj and an expert's gate|up (128 x 128 each), not for the merged q|k|v (256 rows)
    split = _with_threshold(hidden * hidden, path).engine.runner.model
    for layer in split.layers:
        assert layer.attn.o_proj.cpu_dense is not None and layer.mlp.experts.cpu_dense is not None
        assert layer.attn.qkv.cpu_dense is None and layer.attn.qkv.cpu_pack is not None
    assert packed_bytes(split) < packed_bytes(LLM(path, dtype="float32").engine.runner.model)
    bf16 = LLM(path, dtype="bfloat16").engine.runner.model
    assert bf16.layers[0].attn.o_proj.cpu_dense.dtype == torch.bfloat16
    assert bf16.layers[0].mlp.experts.cpu_dense[0].dtype == torch.bfloat16


def test_gptq_linear_dense_copy_matches_reference(default_threshold, monkeypatch):
    k, n = 256, 80
    qweight, qzeros, scales, g_idx = random_gptq(k, n, 64, act_order=True)[0]
    bias = torch.randn(n)
    layer = GPTQLinear(qweight, qzeros, scales, g_idx, 4, 64, bias)
    layer.pack_for_cpu(torch.float32)
    assert layer.cpu_dense is not None and layer.cpu_pack is None
    x = torch.randn(3, k)
    ref = gptq_matmul_ref(x, qweight, qzeros, scales, g_idx) + bias
    assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # act-order parts with different g_idx stay apart as packed layers, merge into one dense one
    other = GPTQLinear(*random_gptq(k, 48, 32, act_order=True, seed=1)[0], 4, 32, None)
    both = ConcatLinear([GPTQLinear(qweight, qzeros, scales, g_idx, 4, 64, bias), other])
    both.pack_for_cpu(torch.float32)
    assert both.cpu_dense is not None and both.cpu_dense.shape == (n + 48, k)
    assert all(p.cpu_dense is None for p in both.parts)  # one dense copy, not two
    monkeypatch.setenv("THRESHER_KERNELS", "torch")
    ref = both(x)
    monkeypatch.delenv("THRESHER_KERNELS")
    assert torch.allclose(both(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the 1 GB benchmark model's smallest 4-bit matrix (k_proj 256 x 1024) stays packed
    assert not cpu_dense.serve_dense(256, 1024) and cpu_dense.serve_dense(256, 256)
    monkeypatch.setenv(cpu_dense.ENV_VAR, "lots")
    with pytest.raises(ValueError, match=cpu_dense.ENV_VAR):
        cpu_dense.serve_dense(1, 1)
