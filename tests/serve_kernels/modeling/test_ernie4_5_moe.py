"""ERNIE-4.5-MoE in the engine: softmax routing with the ``moe_statics`` selection bias,
interleaved rotary, shared experts and the dense first layer, served like transformers for the
base, a pruned and 4-bit variants."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model
from tests.serve_kernels.conftest import prompt_logits, prompt_pass, save_family
from tests.serve_kernels.kernels.helpers import rel_err
from thresher.compress.api import quantize_model
from thresher.models.checkpoint import CheckpointReader
from thresher.models.quantized import load_quantized_model
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.modeling.moe import MoE

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 4000, 12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640]
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory, tiny_demo):
    hf = build_random_model("ernie4_5_moe", vocab_size=4096, intermediate_size=64)
    return hf, save_family(hf, tiny_demo, tmp_path_factory.mktemp("ernie"))


def _greedy(model) -> list[int]:
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None)[0, len(PROMPT):].tolist()


def test_base_routes_and_generates_like_transformers(ernie):
    hf, path = ernie
    llm = LLM(path, block_size=4, dtype="float32")
    layers = llm.engine.runner.model.layers
    assert [isinstance(layer.mlp, MoE) for layer in layers] == [False, True, True]
    assert layers[0].attn.interleaved_rotary and layers[0].attn.rotary_dim == 16  # full width
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


def test_pruned_variant_serves_like_transformers(ernie, tmp_path):
    _, path = ernie
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
    QuantizeStage(method="gptq", group_size=32),
    QuantizeStage(method="awq", group_size=32),
    QuantizeStage(method="nf4", compute_dtype="float32"),
], ids=["gptq4", "awq4", "nf4"])
def test_4bit_variant_serves_like_the_dequantized_transformers_model(ernie, tmp_path, stage,
                                                                      monkeypatch):
    _, path = ernie
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
    # bf16 rounding may flip a near-tied choice on a token; elsewhere the kernels agree
    same = (fast_routed == routed).flatten(1).all(-1)
    assert same.sum() >= len(PROMPT) - 2
    assert rel_err(fast[same], expected[same]) < 2e-2
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(reference)


def test_gpu_path_in_tritons_interpreter_matches_the_cpu_path(ernie, monkeypatch):
    """The Triton kernels (rotary of the de-interleaved heads, paged attention, the routed
    experts) run through Triton's interpreter give the CPU path's greedy tokens."""
    _, path = ernie
    llm = LLM(path, block_size=4, dtype="float32", num_kv_blocks=32, max_model_len=64,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([PROMPT[:9]], params)[0].token_ids
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    assert llm.generate([PROMPT[:9]], params)[0].token_ids == expected


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory, tiny_demo):
    """An MoE layer every second layer after ``moe_layer_start_index`` (1), dense MLPs between:
    layers dense, MoE, dense, MoE, dense."""
    hf = build_random_model("ernie4_5_moe", num_layers=4, vocab_size=4096, intermediate_size=64,
                            moe_layer_interval=2)
    assert [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers] \
        == [False, True, False, True, False]
    return hf, save_family(hf, tiny_demo, tmp_path_factory.mktemp("ernie-interleaved"))


@pytest.mark.parametrize("variant", ["base", "reap50", "gptq4"])
def test_interleaved_moe_layers_prune_quantize_and_serve_like_transformers(
        interleaved, tmp_path, monkeypatch, variant):
    """With ``moe_layer_interval`` 2, pruning and quantizing find the MoE layers where the config
    puts them (the dense ones between are quantized, never pruned), and the engine builds the
    same layers and gives transformers' logits and greedy text."""
    hf, path = interleaved
    source, reference, experts = path, hf, 8
    if variant == "reap50":
        source, experts = tmp_path / "pruned", 4
        prune_model(path, PruneStage(method="reap", ratio=0.5), CAL, source, show_progress=False)
        reference = AutoModelForCausalLM.from_pretrained(source).eval()
    elif variant == "gptq4":
        source = tmp_path / "q"
        quantize_model(path, QuantizeStage(method="gptq", group_size=32), CAL, source,
                       show_progress=False)
        reader = CheckpointReader(source)
        assert {f"model.layers.{i}.mlp.gate_proj.qweight" for i in (0, 2, 4)} <= \
            set(reader.tensor_names())  # the dense layers between the MoE ones too
        assert "model.layers.3.mlp.experts.7.down_proj.qweight" in reader
        reference = load_quantized_model(source)
        monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the dequantizing references, fp32
    llm = LLM(source, block_size=4, dtype="float32")
    layers = llm.engine.runner.model.layers
    assert [layer.mlp.router.out_features if isinstance(layer.mlp, MoE) else 0
            for layer in layers] == [0, experts, 0, experts, 0]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=2e-4, rtol=2e-4)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == _greedy(reference)
