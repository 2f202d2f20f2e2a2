"""Every family's engine model against transformers, and quantized artifacts against the
dequantizing loader."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CALIBRATION_FILE, build_random_model
from tests.serve_kernels.conftest import prompt_logits, save_family
from tests.serve_kernels.kernels.helpers import rel_err
from thresher.compress.api import quantize_model
from thresher.errors import ArtifactError
from thresher.models.quantized import load_quantized_model
from thresher.models.random_init import DENSE_FAMILIES, MOE_FAMILIES
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.kernels.cpu_nf4 import cpu_nf4_available
from thresher.serve_kernels.modeling.linear import (
    AWQLinear,
    GPTQLinear,
    NF4Linear,
    packed_bytes,
)
from thresher.serve_kernels.modeling.moe import ExpertLoop, FusedExperts

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 4000, 12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640]
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_family_logits_and_greedy_match_transformers(family, tiny_demo, tmp_path):
    kw = {"attention_bias": True} if family == "llama" else {}
    if family == "olmoe":
        kw["clip_qkv"] = 0.5
    hf = build_random_model(family, vocab_size=4096, **kw)
    path = save_family(hf, tiny_demo, tmp_path / family)
    llm = LLM(path, block_size=4, dtype="float32")
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=1e-4, rtol=1e-4)
    gen = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                      eos_token_id=None)[0, len(PROMPT):].tolist()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == gen


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_family_logits_in_16_bit_are_as_close_as_transformers_own(family, dtype, tiny_demo,
                                                                  tmp_path):
    """In 16-bit the engine's logits stay within twice the distance of transformers' 16-bit
    logits from its fp32 ones (the rounding both pay), and the engine holds the serving dtype."""
    kw = {"attention_bias": True} if family == "llama" else {}
    if family == "olmoe":
        kw["clip_qkv"] = 0.5
    hf = build_random_model(family, vocab_size=4096, **kw)
    path = save_family(hf, tiny_demo, tmp_path / family)
    with torch.no_grad():
        fp32 = hf(torch.tensor([PROMPT])).logits[0]
        half = hf.to(getattr(torch, dtype))(torch.tensor([PROMPT])).logits[0].float()
    llm = LLM(path, block_size=4, dtype=dtype)
    assert llm.engine.runner.model.embed_tokens.dtype == getattr(torch, dtype)
    rounding = (half - fp32).abs().max()
    assert (prompt_logits(llm, PROMPT) - half).abs().max() <= 2 * rounding


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tiny_demo):
    """Random MoE checkpoints; every input width is a multiple of 64 because bitsandbytes 0.50's
    CPU ``dequantize_4bit`` (the reference loader's) misplaces absmax blocks when a row is
    shorter than the 64-element NF4 block, while the engine's NF4 kernel reads them right."""
    return {f: save_family(build_random_model(f, vocab_size=4096, intermediate_size=64), tiny_demo,
                           tmp_path_factory.mktemp(f)) for f in ("qwen3_moe", "qwen2_moe", "mixtral")}


@pytest.mark.parametrize("family,stage,experts", [
    ("qwen3_moe", QuantizeStage(method="rtn", group_size=32), FusedExperts),
    ("mixtral", QuantizeStage(method="gptq", group_size=32, act_order=True), FusedExperts),
    ("qwen2_moe", QuantizeStage(method="awq", group_size=32), FusedExperts),
    ("qwen3_moe", QuantizeStage(method="nf4", double_quant=True, compute_dtype="float32"), ExpertLoop),
    ("mixtral", QuantizeStage(method="rtn", bits=8, group_size=32), ExpertLoop),
])
def test_quantized_artifact_matches_dequantizing_loader(moe_dirs, tmp_path, family, stage,
                                                        experts, monkeypatch):
    out = tmp_path / "q"
    quantize_model(moe_dirs[family], stage, CAL, out, show_progress=False)
    llm = LLM(out, block_size=4, dtype="float32")
    model = llm.engine.runner.model
    assert all(isinstance(layer.mlp.experts, experts) for layer in model.layers)
    assert llm.engine.model_info["format"] == {"rtn": "gptq"}.get(stage.method, stage.method)
    # the experts are held packed: a fraction of what their fp32 matrices would take
    fp32_experts = 8 * 3 * 64 * model.spec.hidden_size * 4
    # (4-bit: the checkpoint's codes and the CPU pack's, 0.33-0.34 measured; 8-bit: the codes
    # once, in the CPU pack, with fp32 scales per group of 32, 0.35)
    limit = 0.35 if stage.bits == 4 else 0.4
    assert all(packed_bytes(layer.mlp.experts) < limit * fp32_experts for layer in model.layers)
    # 4-bit GPTQ/AWQ experts carry their CPU int4 form, NF4 experts bitsandbytes' CPU NF4 form
    # where the CPU has it (8-bit experts' packs are their linears')
    has_int4 = stage.method != "nf4" and stage.bits == 4
    has_nf4 = stage.method == "nf4" and cpu_nf4_available()
    assert all(bool(layer.mlp.experts.cpu_packs) == (
        has_int4 if isinstance(layer.mlp.experts, FusedExperts) else has_nf4)
        for layer in model.layers)
    # q, k and v are one packed linear (one launch, one CPU kernel call)
    fused = (NF4Linear if stage.method == "nf4" else (GPTQLinear, AWQLinear))
    assert all(isinstance(layer.attn.qkv, fused) for layer in model.layers)
    reference = load_quantized_model(out)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    fast = prompt_logits(llm, PROMPT)  # GPTQ-4/AWQ-4/NF4 run their CPU kernels (bf16)
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the dequantizing references, in fp32
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=2e-4, rtol=2e-4)
    assert rel_err(fast, expected) < 1e-2


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="gptq", group_size=32, act_order=True),
    QuantizeStage(method="awq", group_size=32),
    QuantizeStage(method="nf4", double_quant=True),
    QuantizeStage(method="rtn", bits=8, group_size=32),
], ids=["gptq4", "awq4", "nf4", "int8"])
def test_quantized_artifact_in_bfloat16(moe_dirs, tmp_path, stage):
    """bf16 serving of a packed artifact: within twice the dequantizing loader's own bf16
    rounding of its fp32 logits."""
    out = tmp_path / "q"
    quantize_model(moe_dirs["qwen3_moe"], stage, CAL, out, show_progress=False)
    with torch.no_grad():
        fp32 = load_quantized_model(out)(torch.tensor([PROMPT])).logits[0]
        bf16 = load_quantized_model(out, torch.bfloat16)(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(LLM(out, block_size=4, dtype="bfloat16"), PROMPT)
    assert (got - bf16).abs().max() <= 2 * (bf16 - fp32).abs().max()


def test_tampered_artifact_is_refused(moe_dirs, tmp_path):
    out = tmp_path / "q"
    quantize_model(moe_dirs["qwen3_moe"], QuantizeStage(method="rtn", group_size=32), CAL, out,
                   show_progress=False)
    from thresher.models.manifest import write_manifest

    write_manifest(out)
    LLM(out, dtype="float32")
    (out / "config.json").write_text((out / "config.json").read_text() + " ")
    with pytest.raises(ArtifactError, match="manifest"):
        LLM(out, dtype="float32")
