"""gpt-oss quantized by every method: attention and every expert's gate, up and down under
per-expert names with their biases beside them in full precision; the router (weight and bias)
and the attention sinks stay in full precision; the artifact loads to the driver's model, and
its dequantized checkpoint is the hub's fused layout, which transformers loads."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.compress.api import quantize_model
from thresher.models import get_adapter, load_model, save_model
from thresher.models.quantized import load_quantized_model, write_dequantized
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage, QuantizeStage

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)
PACKED = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "rtn": ("qweight", "qzeros", "scales"),
          "awq": ("qweight", "qzeros", "scales"), "nf4": ("weight", "weight.absmax")}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tiny_demo):
    d = tmp_path_factory.mktemp("gpt_oss")
    save_model(build_random_model("gpt_oss", vocab_size=4096), None, d)
    for f in tiny_demo.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return d


def _tensors(path):
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def _quantize_and_check_reload(model_dir, stage, out):
    """Quantize, and check that the artifact loads to the driver's in-memory (dequantized)
    model, over a prompt longer than the sliding window."""
    states = {}
    report = quantize_model(model_dir, stage, CAL, out, show_progress=False,
                            observer=lambda i, layer, q: states.__setitem__(
                                i, {k: v.clone() for k, v in layer.state_dict().items()}))
    model = load_model(model_dir)
    layers = get_adapter(model.config).layers(model)
    for i, s in states.items():
        layers[i].load_state_dict(s)
    ids = torch.randint(0, 4096, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(load_quantized_model(out)(input_ids=ids).logits,
                                   model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    return report, model


@pytest.mark.parametrize("method", ["gptq", "awq", "nf4", "rtn"])
def test_every_linear_quantized_biases_router_and_sinks_kept(gpt_oss_dir, tmp_path, method):
    out = tmp_path / "out"
    _, base = _quantize_and_check_reload(gpt_oss_dir, QuantizeStage(method=method, group_size=32),
                                         out)
    tensors = _tensors(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    adapter = get_adapter(config["model_type"])
    assert not any(".experts.gate_up_proj" in k or ".experts.down_proj" in k for k in tensors)
    for i in range(2):
        experts = adapter.experts(adapter.layers(base)[i])
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key = adapter.disk_attention_key(i, p)
            assert {f"{key}.{t}" for t in PACKED[method]} <= set(tensors), key
            assert f"{key}.bias" in tensors
        for e in range(8):
            for role in ("gate", "up", "down"):
                key = adapter.disk_expert_key(i, e, role)
                assert {f"{key}.{t}" for t in PACKED[method]} <= set(tensors), key
                if method != "nf4":
                    assert f"{key}.weight" not in tensors, key
            # biases in full precision, deinterleaved from the fused gate_up bias
            bias = experts.gate_up_proj_bias[e]
            torch.testing.assert_close(
                tensors[adapter.disk_expert_key(i, e, "gate") + ".bias"].float(), bias[0::2])
            torch.testing.assert_close(
                tensors[adapter.disk_expert_key(i, e, "up") + ".bias"].float(), bias[1::2])
            torch.testing.assert_close(
                tensors[adapter.disk_expert_key(i, e, "down") + ".bias"].float(),
                experts.down_proj_bias[e])
        router = adapter.disk_router_key(i)
        assert {f"{router}.weight", f"{router}.bias", f"model.layers.{i}.self_attn.sinks"} <= set(
            tensors)
        assert router in qc.get("modules_to_not_convert", qc.get("llm_int8_skip_modules"))


def test_mixed_precision_covers_every_gpt_oss_linear(gpt_oss_dir, tmp_path):
    out = tmp_path / "out"
    report, _ = _quantize_and_check_reload(
        gpt_oss_dir, QuantizeStage(method="gptq", bits="auto", target_bits=3.5, group_size=32),
        out)
    names = set(_tensors(out))
    for key in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.experts.7.down_proj",
                "model.layers.1.mlp.experts.3.up_proj"):
        assert f"{key}.qweight" in names, key
    assert report.metrics()["quantized_matrices"] > 0


@pytest.mark.parametrize(("method", "ratio"), [("gptq", 0.0), ("rtn", 0.5)],
                         ids=["gptq4", "reap50-rtn4"])
def test_dequantized_artifact_is_the_hub_layout_transformers_loads(gpt_oss_dir, tmp_path, method,
                                                                  ratio):
    """write_dequantized fuses each layer's per-expert weights and biases back into the hub
    tensors (gate and up interleaved in columns, down transposed): transformers finds every
    tensor it expects and computes the artifact's logits."""
    source = gpt_oss_dir
    if ratio:
        source = tmp_path / "pruned"
        prune_model(gpt_oss_dir, PruneStage(method="reap", ratio=ratio), CAL, source,
                    show_progress=False)
    quantize_model(source, QuantizeStage(method=method, bits=4, group_size=32), CAL,
                   tmp_path / "q", show_progress=False)
    plain = write_dequantized(tmp_path / "q", tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_local_experts"] == round(8 * (1 - ratio))
    names = set(_tensors(plain))
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj_bias",
            "model.layers.1.mlp.router.bias"} <= names
    assert not any(".experts.0." in k for k in names)
    model, info = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                       output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    quantized = load_quantized_model(tmp_path / "q")
    adapter = get_adapter(model.config)
    for i in range(2):  # the very weights the artifact computes with, and its biases
        loaded, packed = adapter.layers(model)[i], adapter.layers(quantized)[i].mlp.experts
        for e in range(config["num_local_experts"]):
            view, bias = adapter.expert_view(loaded, e), adapter.expert_biases(loaded, e)
            for role in ("gate", "up", "down"):
                module = getattr(packed, role)[e]
                assert torch.equal(getattr(view, role), module.weight_float()), (i, e, role)
                assert torch.equal(getattr(bias, role), module.bias), (i, e, role)
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = quantized(input_ids=ids).logits
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_model(plain)(input_ids=ids).logits, want, rtol=1e-5,
                                   atol=1e-5)
