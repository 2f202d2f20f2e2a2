"""GLM-4.5 quantized by every method: every linear a hub GLM-4.5 quantization quantizes (attention,
the dense first layer, shared experts, every routed expert) under hub per-expert names; the
router and its score-correction bias stay in full precision."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.compress.api import quantize_model
from thresher.models import get_adapter, load_model, save_model
from thresher.models.quantized import load_quantized_model
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)
PACKED = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "rtn": ("qweight", "qzeros", "scales"),
          "awq": ("qweight", "qzeros", "scales"), "nf4": ("weight", "weight.absmax")}


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory, tiny_demo):
    d = tmp_path_factory.mktemp("glm")
    save_model(build_random_model("glm4_moe", vocab_size=4096), None, d)
    for f in tiny_demo.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return d


def _names(path):
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("method", ["gptq", "awq", "nf4", "rtn"])
def test_every_linear_quantized_router_kept(glm_dir, tmp_path, method):
    out = tmp_path / "out"
    states = {}
    quantize_model(glm_dir, QuantizeStage(method=method, group_size=32), CAL, out,
                   show_progress=False,
                   observer=lambda i, layer, q: states.__setitem__(
                       i, {k: v.clone() for k, v in layer.state_dict().items()}))
    names = _names(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    adapter = get_adapter(config["model_type"])
    assert config["num_nextn_predict_layers"] == 0
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
        assert {f"{router}.weight", f"{router}.e_score_correction_bias"} <= names
        assert router in qc.get("modules_to_not_convert", qc.get("llm_int8_skip_modules"))
    assert "model.layers.1.mlp.shared_experts.down_proj" in linears
    for key in linears:
        assert {f"{key}.{t}" for t in PACKED[method]} <= names, key
        if method != "nf4":
            assert f"{key}.weight" not in names, key
    assert "model.layers.1.self_attn.q_proj.bias" in names  # GLM's q/k/v biases, kept

    model = load_model(glm_dir)
    layers = get_adapter(model.config).layers(model)
    for i, s in states.items():
        layers[i].load_state_dict(s)
    loaded = load_quantized_model(out)
    ids = torch.randint(0, 4096, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
