"""DeepSeek-V3 in the engine: multi-head latent attention served from a latent paged cache
(kv_b absorbed), yarn-scaled interleaved rotary, GLM-4.5's router, shared experts and the dense
first layer, served like transformers for the base, a pruned and 4-bit variants; the cache's bytes
per token reported by ``/v1/models``."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model
from tests.serve_kernels.conftest import prompt_logits, prompt_pass, save_family
from tests.serve_kernels.kernels.helpers import rel_err
from thresher.compress.api import quantize_model
from thresher.models.quantized import load_quantized_model
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage, QuantizeStage
from thresher.serve_kernels import LLM, LLMEngine, SamplingParams
from thresher.serve_kernels.modeling.mla import LatentAttention
from thresher.serve_kernels.modeling.moe import MoE
from thresher.serve_kernels.server import BackgroundServer, ServerConfig, build_app

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 4000, 12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640]
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory, tiny_demo):
    hf = build_random_model("deepseek_v3", vocab_size=4096, intermediate_size=64)
    return hf, save_family(hf, tiny_demo, tmp_path_factory.mktemp("dsv3"))


def _greedy(model) -> list[int]:
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None)[0, len(PROMPT):].tolist()


def test_base_serves_from_a_latent_cache_like_transformers(dsv3):
    hf, path = dsv3
    llm = LLM(path, block_size=4, dtype="float32")
    engine = llm.engine
    layers = engine.runner.model.layers
    assert [isinstance(layer.mlp, MoE) for layer in layers] == [False, True, True]
    assert all(isinstance(layer.attn, LatentAttention) for layer in layers)
    config = hf.config
    width = config.kv_lora_rank + config.qk_rope_head_dim
    # one cache tensor per layer holding [latent, rotary key] per token, not expanded heads
    assert all(len(kv) == 1 and kv[0].shape[1:] == (4, 1, width) for kv in engine.runner.kv_caches)
    assert engine.model_info["kv_bytes_per_token"] == width * 3 * 4  # 3 layers, fp32
    logits, routed = prompt_pass(llm, PROMPT)
    captured: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, o: captured.append(o[2]))
             for layer in hf.model.layers[1:]]
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    for n, chosen in enumerate(captured):  # the engine chose transformers' experts
        assert torch.equal(routed[:, n], chosen.sort(-1).values)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(hf)


@pytest.mark.parametrize("overrides", [
    dict(q_lora_rank=None),  # the query as one projection (DeepSeek-V2-Lite's layout)
    dict(rope_interleave=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
], ids=["no-query-rank", "plain-rope"])
def test_attention_variants_serve_like_transformers(tmp_path, tiny_demo, overrides):
    hf = build_random_model("deepseek_v3", vocab_size=4096, **overrides)
    llm = LLM(save_family(hf, tiny_demo, tmp_path / "m"), block_size=4, dtype="float32")
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=1e-4, rtol=1e-4)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(hf)


def test_pruned_variant_serves_like_transformers(dsv3, tmp_path):
    _, path = dsv3
    out = tmp_path / "pruned"
    prune_model(path, PruneStage(method="reap", ratio=0.5), CAL, out, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    llm = LLM(out, block_size=4, dtype="float32")
    assert [layer.mlp.router.out_features for layer in llm.engine.runner.model.layers
            if isinstance(layer.mlp, MoE)] == [4, 4]
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=1e-4, rtol=1e-4)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(hf)


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="gptq", group_size=16),
    QuantizeStage(method="awq", group_size=16),
    QuantizeStage(method="nf4", compute_dtype="float32"),
], ids=["gptq4", "awq4", "nf4"])
def test_4bit_variant_serves_like_the_dequantized_transformers_model(dsv3, tmp_path, stage,
                                                                      monkeypatch):
    """Every MLA projection quantized (kv_b dequantized once for absorption)."""
    _, path = dsv3
    out = tmp_path / "q"
    quantize_model(path, stage, CAL, out, show_progress=False)
    reference = load_quantized_model(out)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    llm = LLM(out, block_size=4, dtype="float32")
    fast, fast_routed = prompt_pass(llm, PROMPT)  # the CPU 4-bit kernels, bf16 activations
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the dequantizing references, in fp32
    exact, routed = prompt_pass(llm, PROMPT)
    torch.testing.assert_close(exact, expected, atol=2e-4, rtol=2e-4)
    # bf16 rounding may flip a near-tied sigmoid choice on a token; elsewhere the kernels agree
    same = (fast_routed == routed).flatten(1).all(-1)
    assert same.sum() >= len(PROMPT) - 2
    assert rel_err(fast[same], expected[same]) < 2e-2
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(reference)


def test_models_endpoint_reports_the_latent_cache_bytes_per_token(dsv3):
    """(kv_lora_rank + qk_rope_head_dim) x layers x dtype size, in bf16 here."""
    hf, path = dsv3
    engine = LLMEngine(path, max_num_seqs=2, max_model_len=64, dtype="bfloat16")
    config = hf.config
    want = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * 2
    with BackgroundServer(build_app(engine, ServerConfig(served_model_name="dsv3"))) as srv:
        card = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]
    assert card["attention"] == "mla" and card["kv_bytes_per_token"] == want


def test_gpu_path_in_tritons_interpreter_matches_the_cpu_path(dsv3, monkeypatch):
    """The Triton kernels (rotary on the decoupled parts, the latent row stored once, paged
    attention with one kv head of latent + rotary width, the routed experts) run through Triton's
    interpreter give the CPU path's greedy tokens."""
    _, path = dsv3
    llm = LLM(path, block_size=4, dtype="float32", num_kv_blocks=32, max_model_len=64,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([PROMPT[:9]], params)[0].token_ids
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    assert llm.generate([PROMPT[:9]], params)[0].token_ids == expected
