"""Qwen3.5-MoE: the hub's multimodal layout read as the text model (language-model names, fused
experts, vision tower and MTP left out), and the layer-by-layer path equal to transformers."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

from tests.conftest import build_random_model
from tests.prune.test_glm4_moe import _layerwise_logits
from thresher.models import get_adapter, load_model, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.models.layerwise import load_config


@pytest.fixture(scope="module")
def qwen35():
    return build_random_model("qwen3_5_moe")


def write_hub_checkpoint(model, path):
    """``model`` as Qwen publishes Qwen3.5-MoE: the multimodal config with the text model as
    ``text_config``, language-model tensors under ``model.language_model.``, experts fused,
    beside a vision tower and an MTP block (made-up tensors: thresher must leave them out)."""
    path.mkdir(parents=True)
    tensors = {}
    for key, t in model.state_dict().items():
        name = key.replace("model.", "model.language_model.", 1) if key.startswith("model.") \
            else key
        tensors[name] = t.contiguous()
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2, 2)
    tensors["mtp.fc.weight"] = torch.zeros(8, 16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = Qwen3_5MoeConfig(text_config=model.config.to_dict(),
                              vision_config=dict(depth=1, hidden_size=8, num_heads=1,
                                                 intermediate_size=8, out_hidden_size=64))
    config.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    return path


def test_random_config_has_both_token_mixers(qwen35):
    ad = get_adapter(qwen35.config)
    assert qwen35.config.layer_types == ["linear_attention", "full_attention"] * 2
    assert ad.linear_attention_layers(qwen35.config) == [0, 2]
    assert ad.norm_weight_offset == 1.0 and ad.forward_renormalizes(qwen35.config)
    assert ad.attention(ad.layers(qwen35)[0]) is ad.layers(qwen35)[0].linear_attn
    assert ad.attention(ad.layers(qwen35)[1]) is ad.layers(qwen35)[1].self_attn


def test_hub_layout_reads_as_the_text_model(qwen35, tmp_path):
    hub = write_hub_checkpoint(qwen35, tmp_path / "hub")
    config = load_config(hub)
    assert config.model_type == "qwen3_5_moe_text"
    reader = CheckpointReader(hub)
    names = reader.tensor_names()
    assert "model.layers.0.linear_attn.A_log" in names and "model.embed_tokens.weight" in names
    assert not any(n.startswith(("model.visual.", "mtp.", "model.language_model.")) for n in names)
    torch.testing.assert_close(reader.get("model.layers.1.self_attn.q_proj.weight"),
                               qwen35.model.layers[1].self_attn.q_proj.weight)
    ids = torch.randint(0, qwen35.config.vocab_size, (2, 11))
    with torch.no_grad():
        want = qwen35(input_ids=ids).logits
    # layer by layer (fused experts read as they are stored), and as a whole model
    torch.testing.assert_close(_layerwise_logits(hub, ids), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # as below: equal up to the summation order of fp32 kernels
        torch.testing.assert_close(load_model(hub)(input_ids=ids).logits, want, rtol=1e-5,
                                   atol=1e-5)


def test_written_text_model_loads_in_transformers(qwen35, tmp_path):
    """A checkpoint thresher writes is the text model under per-expert names; transformers and
    thresher's layer-by-layer evaluation give the model's logits."""
    save_model(qwen35, None, tmp_path)
    names = CheckpointReader(tmp_path).tensor_names()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, qwen35.config.vocab_size, (2, 13))
    with torch.no_grad():
        want = qwen35(input_ids=ids).logits
        # bit for bit on an AVX512 CPU; 1e-6 apart on an AVX2 one (the weights' placement in
        # memory can change the summation order of fp32 kernels)
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_layerwise_logits(tmp_path, ids), want, rtol=1e-5, atol=1e-5)


def test_hub_fused_experts_read_one_expert_at_a_time(qwen35, tmp_path):
    """The hub's fused experts ([E, 2I, H] gate|up, [E, H, I] down) appear under per-expert names
    with their own shapes, so readers that go expert by expert (the engine, GGUF export) read the
    hub checkpoint as they read thresher's."""
    hub = write_hub_checkpoint(qwen35, tmp_path / "hub")
    reader = CheckpointReader(hub)
    experts = qwen35.model.layers[2].mlp.experts
    inter = experts.down_proj.shape[-1]
    assert "model.layers.2.mlp.experts.gate_up_proj" not in reader
    for e in (0, 7):
        key = f"model.layers.2.mlp.experts.{e}."
        torch.testing.assert_close(reader.get(key + "gate_proj.weight"),
                                   experts.gate_up_proj[e, :inter])
        torch.testing.assert_close(reader.get(key + "up_proj.weight"),
                                   experts.gate_up_proj[e, inter:])
        torch.testing.assert_close(reader.get(key + "down_proj.weight"), experts.down_proj[e])
        assert reader.shape(key + "up_proj.weight") == (inter, qwen35.config.hidden_size)
    reader.check_against_config(load_config(hub))
