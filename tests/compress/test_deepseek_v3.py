"""DeepSeek-V3 quantized by every method: latent attention's projections (q_a, q_b, kv_a, kv_b,
o) as calibrated linears with their low-rank norms kept in float, the dense first layer, shared
experts and every routed expert under hub per-expert names; the router and its correction bias
stay in full precision."""

import json
import shutil

import pytest
from safetensors import safe_open

from tests.compress.test_glm4_moe import PACKED, _quantize_and_check_reload
from tests.conftest import build_random_model
from thresher.compress.targets import LayerParts, scaling_groups, sequential_stages
from thresher.models import get_adapter, save_model
from thresher.recipe import QuantizeStage

MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.fixture(scope="module")
def dsv3_dir(tmp_path_factory, tiny_demo):
    d = tmp_path_factory.mktemp("dsv3")
    save_model(build_random_model("deepseek_v3", vocab_size=4096), None, d)
    for f in tiny_demo.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return d


def _names(path):
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def test_mla_stages_and_awq_groups_follow_the_inputs():
    """GPTQ's order: q_a/kv_a on the layer input, then q_b and kv_b on their norms' outputs, then
    o; AWQ folds q_b's and kv_b's scales into the low-rank norms."""
    model = build_random_model("deepseek_v3")
    adapter = get_adapter(model.config)
    parts = LayerParts(adapter, adapter.layers(model)[1], 1, set())
    stages = sequential_stages(parts)
    assert [[t.role for s in stage for t in s.targets] for stage in stages[:3]] == [
        ["q_a_proj", "kv_a_proj_with_mqa"], ["q_b_proj", "kv_b_proj"], ["o_proj"]]
    attn = adapter.attention(adapter.layers(model)[1])
    groups = {g.name: g for g in scaling_groups(parts)}
    assert groups["layer 1 q_a/kv_a"].prev_norm is adapter.input_norm(adapter.layers(model)[1])
    assert groups["layer 1 q_b"].prev_norm is attn.q_a_layernorm
    assert groups["layer 1 kv_b"].prev_norm is attn.kv_a_layernorm
    assert "layer 1 o_proj" not in groups  # no v_proj to fold o's scale into


@pytest.mark.parametrize("method", ["gptq", "awq", "nf4", "rtn"])
def test_every_linear_quantized_norms_and_router_kept(dsv3_dir, tmp_path, method):
    out = tmp_path / "out"
    _quantize_and_check_reload(dsv3_dir, QuantizeStage(method=method, group_size=16), out)
    names = _names(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    adapter = get_adapter(config["model_type"])
    assert config["num_nextn_predict_layers"] == 0
    linears = [adapter.disk_dense_mlp_key(0, p) for p in ("gate_proj", "up_proj", "down_proj")]
    for i in range(3):
        linears += [adapter.disk_attention_key(i, p) for p in MLA]
        for norm in ("q_a_layernorm", "kv_a_layernorm"):
            assert adapter.disk_attention_key(i, norm) + ".weight" in names
    for i in (1, 2):
        linears += [adapter.disk_shared_expert_key(i, p) for p in ("gate_proj", "up_proj",
                                                                   "down_proj")]
        linears += [adapter.disk_expert_key(i, e, r) for e in range(8) for r in ("gate", "up",
                                                                                 "down")]
        router = adapter.disk_router_key(i)
        assert {f"{router}.weight", f"{router}.e_score_correction_bias"} <= names
        assert router in qc.get("modules_to_not_convert", qc.get("llm_int8_skip_modules"))
    for key in linears:
        assert {f"{key}.{t}" for t in PACKED[method]} <= names, key
        if method != "nf4":
            assert f"{key}.weight" not in names, key


def test_mixed_precision_covers_the_latent_projections(dsv3_dir, tmp_path):
    """``bits: auto`` over the same linears; kv_a's 48 rows (latent 32 + rotary 16) rule out
    3-bit GPTQ packing, so the candidates are 2, 4 and 8."""
    out = tmp_path / "out"
    report = _quantize_and_check_reload(
        dsv3_dir, QuantizeStage(method="gptq", bits="auto", target_bits=3.5, group_size=16,
                               candidate_bits=[2, 4, 8]), out)
    names = _names(out)
    for key in ("model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.q_a_proj",
                "model.layers.2.mlp.shared_experts.up_proj",
                "model.layers.1.mlp.experts.7.down_proj"):
        assert f"{key}.qweight" in names, key
    assert report.metrics()["quantized_matrices"] > 0
