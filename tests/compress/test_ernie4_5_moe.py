"""ERNIE-4.5-MoE quantized by every method: every linear a hub ERNIE-4.5 quantization quantizes
(attention, the dense first layer, shared experts, every routed expert) under hub per-expert names;
the router and its ``moe_statics`` bias stay in full precision."""

import json
import shutil

import pytest
from safetensors import safe_open

from tests.compress.test_glm4_moe import PACKED, _quantize_and_check_reload
from tests.conftest import build_random_model
from thresher.models import get_adapter, save_model
from thresher.recipe import QuantizeStage


@pytest.fixture(scope="module")
def ernie_dir(tmp_path_factory, tiny_demo):
    d = tmp_path_factory.mktemp("ernie")
    save_model(build_random_model("ernie4_5_moe", vocab_size=4096), None, d)
    for f in tiny_demo.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return d


def _names(path):
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("method", ["gptq", "awq", "nf4", "rtn"])
def test_every_linear_quantized_router_kept(ernie_dir, tmp_path, method):
    out = tmp_path / "out"
    _quantize_and_check_reload(ernie_dir, QuantizeStage(method=method, group_size=32), out)
    names = _names(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    adapter = get_adapter(config["model_type"])
    linears = [adapter.disk_dense_mlp_key(0, p) for p in ("gate_proj", "up_proj", "down_proj")]
    for i in range(3):
        linears += [adapter.disk_attention_key(i, p) for p in ("q_proj", "k_proj", "v_proj",
                                                                "o_proj")]
    for i in (1, 2):
        linears += [adapter.disk_shared_expert_key(i, p) for p in ("gate_proj", "up_proj",
                                                                   "down_proj")]
        linears += [adapter.disk_expert_key(i, e, r) for e in range(8) for r in ("gate", "up",
                                                                                 "down")]
        router = adapter.disk_router_key(i)
        assert {f"{router}.weight", adapter.disk_router_correction_key(i)} <= names
        assert router in qc.get("modules_to_not_convert", qc.get("llm_int8_skip_modules"))
    assert "model.layers.1.mlp.shared_experts.down_proj" in linears
    for key in linears:
        assert {f"{key}.{t}" for t in PACKED[method]} <= names, key
        if method != "nf4":
            assert f"{key}.weight" not in names, key


def test_mixed_precision_covers_every_ernie_linear(ernie_dir, tmp_path):
    """``bits: auto`` allocates widths over the same linears (shared experts and the dense layer
    among them) and the artifact loads to the driver's in-memory model."""
    out = tmp_path / "out"
    report = _quantize_and_check_reload(
        ernie_dir, QuantizeStage(method="gptq", bits="auto", target_bits=3.5, group_size=32), out)
    names = _names(out)
    for key in ("model.layers.0.mlp.down_proj", "model.layers.2.mlp.shared_experts.up_proj",
                "model.layers.1.mlp.experts.7.down_proj"):
        assert f"{key}.qweight" in names, key
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in names
    assert report.metrics()["quantized_matrices"] > 0
