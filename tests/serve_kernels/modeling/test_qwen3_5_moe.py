"""Qwen3.5-MoE in the engine: Gated DeltaNet layers with a per-sequence recurrent state beside
the paged KV cache of the gated full-attention layers, served like transformers for the base, a
pruned and 4-bit variants, under continuous batching, chunked prefill and preemption."""

from __future__ import annotations

import copy

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
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.speculative import SpeculativeConfig
from thresher.serve_kernels.modeling.deltanet import GatedAttention, GatedDeltaNet

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 4000, 12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640]
PROMPTS = [PROMPT, PROMPT[3:10], [44, 2048, 7, 3001, 96, 5, 17, 300, 11, 4095, 1, 64, 900]]
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, tiny_demo):
    hf = build_random_model("qwen3_5_moe", vocab_size=4096)
    return hf, save_family(hf, tiny_demo, tmp_path_factory.mktemp("qwen35"))


def _greedy(model, prompt: list[int] = PROMPT) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None)[0, len(prompt):].tolist()


def test_base_routes_and_generates_like_transformers(qwen35):
    hf, path = qwen35
    llm = LLM(path, block_size=4, dtype="float32")
    layers = llm.engine.runner.model.layers
    assert [type(layer.attn) for layer in layers] == [GatedDeltaNet, GatedAttention] * 2
    assert layers[1].attn.rotary_dim == 8  # a quarter of each 32-wide head
    logits, routed = prompt_pass(llm, PROMPT)
    captured: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, o: captured.append(o[2]))
             for layer in hf.model.layers]
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    for n, chosen in enumerate(captured):  # the engine chose transformers' experts
        assert torch.equal(routed[:, n], chosen.sort(-1).values)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(hf)


def test_batched_chunked_and_preempted_sequences_keep_their_own_state(qwen35):
    """Three prompts at once, prefilled in chunks of 5 tokens beside each other's decode steps,
    in a cache too small for all three (the last admitted is preempted and recomputed from
    position 0, its state started again): each generates what transformers generates for it
    alone; a second round reuses the slots from fresh states."""
    hf, path = qwen35
    llm = LLM(path, block_size=4, max_num_seqs=3, max_num_batched_tokens=5, num_kv_blocks=14,
              max_model_len=32, dtype="float32")
    want = [_greedy(hf, p) for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.engine.scheduler.num_preempted_total > 0
    assert [o.token_ids for o in llm.generate(PROMPTS[::-1], GREEDY)] == want[::-1]


def test_recurrent_models_refuse_speculation_and_skip_prefix_caching(qwen35):
    _, path = qwen35
    with pytest.raises(ValueError, match="speculative"):
        LLM(path, speculative=SpeculativeConfig(draft="ngram"), dtype="float32")
    llm = LLM(path, block_size=4, dtype="float32")  # prefix caching asked for (the default), turned off
    assert not llm.engine.block_manager.enable_prefix_caching


def test_pruned_variant_serves_like_transformers(qwen35, tmp_path):
    _, path = qwen35
    out = tmp_path / "pruned"
    prune_model(path, PruneStage(method="reap", ratio=0.5), CAL, out, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    llm = LLM(out, block_size=4, dtype="float32")
    assert [layer.mlp.router.out_features for layer in llm.engine.runner.model.layers] == [4] * 4
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=1e-4, rtol=1e-4)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(hf)


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="gptq", group_size=32),
    QuantizeStage(method="awq", group_size=32),
    QuantizeStage(method="nf4", compute_dtype="float32"),
], ids=["gptq4", "awq4", "nf4"])
def test_4bit_variant_serves_like_the_dequantized_transformers_model(qwen35, tmp_path, stage,
                                                                      monkeypatch):
    _, path = qwen35
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
    # bf16 rounding flips near-tied choices of this random router on a few tokens (as it does
    # in transformers' own bf16 forward); elsewhere the kernels agree
    same = (fast_routed == routed).flatten(1).all(-1)
    assert same.sum() >= len(PROMPT) - 4
    # the recurrence carries bf16 rounding along the prompt: the bound is what transformers'
    # own bf16 forward of the same weights pays (twice), as for every family in 16 bits
    with torch.no_grad():
        half = copy.deepcopy(reference).to(torch.bfloat16)(torch.tensor([PROMPT])).logits[0]
    rounding = rel_err(half[same].float(), expected[same])
    assert rel_err(fast[same], expected[same]) < max(2e-2, 2 * rounding)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(reference)


def test_gpu_path_in_tritons_interpreter_matches_the_cpu_path(qwen35, monkeypatch):
    """The Triton kernels (rotary over the partial heads, paged attention of the gated layers,
    the routed experts) run through Triton's interpreter give the CPU path's greedy tokens."""
    _, path = qwen35
    llm = LLM(path, block_size=4, dtype="float32", num_kv_blocks=32, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([PROMPT[:9]], params)[0].token_ids
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    assert llm.generate([PROMPT[:9]], params)[0].token_ids == expected


def test_only_full_attention_layers_hold_kv_blocks(qwen35):
    """The paged cache is sized and allocated for the two gated-attention layers; the DeltaNet
    layers' entries are empty (their state is per sequence, not per token, and is allocated for
    every sequence slot before the cache is sized)."""
    _, path = qwen35
    llm = LLM(path, block_size=4, num_kv_blocks=16, max_model_len=64, dtype="float32")
    runner = llm.engine.runner
    assert [c[0].numel() > 0 for c in runner.kv_caches] == [False, True] * 2
    spec = runner.model.spec
    per_block = 2 * 2 * 4 * spec.num_kv_heads * spec.head_dim * 4  # K and V, 2 layers, fp32
    assert runner.kv_bytes_per_block(runner.model, 4, torch.float32) == per_block
    # every slot's state is allocated up front: 2 DeltaNet layers x 64 slots x (fp32 delta state
    # of 4 heads x 16 x 16, conv's last 3 inputs of 128 channels)
    size = runner.model.embed_tokens.element_size()
    assert llm.engine.model_info["recurrent_state_bytes"] == 2 * 64 * (4 * 16 * 16 * 4
                                                                        + 128 * 3 * size)

def test_the_hub_checkpoint_serves_like_its_text_model(qwen35, tmp_path, tiny_demo):
    """The multimodal hub layout (language model under ``model.language_model.``, fused experts,
    a vision tower and an MTP block beside it) serves as the base variant does in validation."""
    from tests.models.test_qwen35 import write_hub_checkpoint

    hf, _ = qwen35
    hub = write_hub_checkpoint(hf, tmp_path / "hub")
    for f in tiny_demo.glob("tokenizer*"):
        (hub / f.name).write_bytes(f.read_bytes())
    llm = LLM(hub, block_size=4, dtype="float32")
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=1e-4, rtol=1e-4)
