"""Qwen3.5-MoE quantized by every method: full attention, the Gated DeltaNet's in_proj_qkv /
in_proj_z / out_proj, shared and routed experts under hub per-expert names; in_proj_a / in_proj_b,
conv1d, A_log, dt_bias, the router and the shared-expert gate stay in full precision. AWQ's scales
fold into the zero-centered norms (1 + weight) without changing the float model."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.compress.test_glm4_moe import PACKED, _quantize_and_check_reload
from tests.conftest import build_random_model
from thresher.compress.targets import LayerParts, apply_scale, scaling_groups
from thresher.models import get_adapter, save_model
from thresher.recipe import QuantizeStage

DELTANET_QUANTIZED = ("in_proj_qkv", "in_proj_z", "out_proj")
DELTANET_FLOAT = ("in_proj_a", "in_proj_b")


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory, tiny_demo):
    d = tmp_path_factory.mktemp("qwen35")
    save_model(build_random_model("qwen3_5_moe", vocab_size=4096), None, d)
    for f in tiny_demo.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return d


def _names(path):
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("method", ["gptq", "awq", "nf4", "rtn"])
def test_every_linear_quantized_router_and_deltanet_gates_kept(qwen35_dir, tmp_path, method):
    out = tmp_path / "out"
    _quantize_and_check_reload(qwen35_dir, QuantizeStage(method=method, group_size=32), out)
    names = _names(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    skipped = qc.get("modules_to_not_convert", qc.get("llm_int8_skip_modules"))
    adapter = get_adapter(config["model_type"])
    linears = []
    for i in range(4):
        if config["layer_types"][i] == "linear_attention":
            linears += [f"model.layers.{i}.linear_attn.{p}" for p in DELTANET_QUANTIZED]
            for p in DELTANET_FLOAT:
                assert f"model.layers.{i}.linear_attn.{p}.weight" in names
                assert f"model.layers.{i}.linear_attn.{p}" in skipped
            assert {f"model.layers.{i}.linear_attn.{t}" for t in
                    ("conv1d.weight", "A_log", "dt_bias", "norm.weight")} <= names
        else:
            linears += [adapter.disk_attention_key(i, p) for p in ("q_proj", "k_proj", "v_proj",
                                                                    "o_proj")]
        linears += [adapter.disk_shared_expert_key(i, p) for p in ("gate_proj", "up_proj",
                                                                   "down_proj")]
        linears += [adapter.disk_expert_key(i, e, r) for e in range(8) for r in ("gate", "up",
                                                                                 "down")]
        for kept in (adapter.disk_router_key(i), adapter.disk_shared_expert_gate_key(i)):
            assert f"{kept}.weight" in names and kept in skipped
    for key in linears:
        assert {f"{key}.{t}" for t in PACKED[method]} <= names, key
        if method != "nf4":
            assert f"{key}.weight" not in names, key


def test_mixed_precision_covers_every_qwen35_linear(qwen35_dir, tmp_path):
    """``bits: auto`` allocates widths over the same linears and the artifact loads to the
    driver's in-memory model."""
    out = tmp_path / "out"
    report = _quantize_and_check_reload(
        qwen35_dir, QuantizeStage(method="gptq", bits="auto", target_bits=3.5, group_size=32), out)
    names = _names(out)
    for key in ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.2.linear_attn.out_proj",
                "model.layers.1.self_attn.q_proj", "model.layers.3.mlp.shared_expert.up_proj",
                "model.layers.1.mlp.experts.7.down_proj"):
        assert f"{key}.qweight" in names, key
    assert "model.layers.0.linear_attn.in_proj_b.weight" in names
    assert report.metrics()["quantized_matrices"] > 0


@torch.no_grad()
def test_awq_scales_leave_the_float_layer_unchanged():
    """Every AWQ group's scale folded into the layer (a zero-centered norm divides 1 + weight,
    the DeltaNet's 16-bit in_proj_a/b and the router are compensated) leaves both kinds of
    layer computing what they computed."""
    model = build_random_model("qwen3_5_moe")
    adapter = get_adapter(model.config)
    x = torch.randn(2, 9, model.config.hidden_size)
    pos = torch.arange(9).unsqueeze(0).expand(2, -1)
    pe = model.model.rotary_emb(x, pos)
    for i in (0, 1):
        layer = adapter.layers(model)[i]
        before = layer(x, position_embeddings=pe)
        groups = scaling_groups(LayerParts(adapter, layer, i, set()))
        assert len(groups) >= 2
        for g in groups:
            apply_scale(g, torch.rand(g.site.columns) + 0.5)
        torch.testing.assert_close(layer(x, position_embeddings=pe), before, rtol=1e-4,
                                   atol=1e-5)


def test_a_hub_checkpoint_quantizes_to_the_text_model(qwen35_dir, tmp_path):
    """From the multimodal hub layout the quantized artifact is the text model: its config
    (``qwen3_5_moe_text`` with the quantization_config), no vision or MTP tensors, and it loads to
    the driver's in-memory model."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_qwen35 import write_hub_checkpoint

    model = AutoModelForCausalLM.from_pretrained(qwen35_dir).eval()
    hub = write_hub_checkpoint(model, tmp_path / "hub")
    for f in qwen35_dir.glob("tokenizer*"):
        shutil.copy(f, hub / f.name)
    out = tmp_path / "out"
    _quantize_and_check_reload(hub, QuantizeStage(method="rtn", group_size=32), out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and "text_config" not in config
    assert config["quantization_config"]["bits"] == 4
    names = _names(out)
    assert not any(n.startswith(("model.visual.", "mtp.", "model.language_model.")) for n in names)
    assert "model.layers.0.mlp.experts.5.down_proj.qweight" in names
