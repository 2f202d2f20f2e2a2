"""The quantize stage end to end on random-init models of every family: options checked before
compute, standard tensor names, quantization_config, atomic output, and the loader reproducing the
driver's in-memory model."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.compress.api import quantize_model
from thresher.errors import ArtifactError, CompressionError
from thresher.models import get_adapter, load_model, save_model
from thresher.models.quantized import load_quantized_model
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage

# A small local text keeps calibration fast (the stdlib corpus is tokenized per tokenizer path).
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_demo):
    """Random-init checkpoints of each family, with the tiny demo tokenizer for calibration."""
    dirs = {}
    for family in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "llama"):
        d = tmp_path_factory.mktemp(family)
        save_model(build_random_model(family, vocab_size=4096), None, d)
        for f in tiny_demo.glob("tokenizer*"):
            shutil.copy(f, d / f.name)
        dirs[family] = d
    return dirs


def tensor_names(path):
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def quantize_and_capture(model_dir, stage, out):
    """Quantize, keeping the driver's in-memory (dequantized) layers to compare with."""
    states = {}
    report = quantize_model(model_dir, stage, CAL, out, show_progress=False,
                            observer=lambda i, layer, q: states.__setitem__(
                                i, {k: v.clone() for k, v in layer.state_dict().items()}))
    model = load_model(model_dir)
    layers = get_adapter(model.config).layers(model)
    for i, s in states.items():
        layers[i].load_state_dict(s)
    return report, model


@pytest.mark.parametrize("family,method", [("mixtral", "gptq"), ("qwen2_moe", "awq"),
                                           ("olmoe", "nf4"), ("llama", "rtn"),
                                           ("qwen3_moe", "gptq")])
def test_artifact_names_config_and_reload(family_dirs, tmp_path, family, method):
    kw = {"group_size": 32}
    if family == "qwen3_moe":
        kw.update(act_order=True, bits=8)
    stage = QuantizeStage(method=method, **kw)
    out = tmp_path / "out"
    report, in_memory = quantize_and_capture(family_dirs[family], stage, out)
    names = tensor_names(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    adapter = get_adapter(config["model_type"])
    if adapter.is_moe:
        expert = adapter.disk_expert_key(1, 7, "down")
        router = adapter.disk_router_key(1)
        assert f"{router}.weight" in names and router in qc.get(
            "modules_to_not_convert", qc.get("llm_int8_skip_modules"))
        assert not any(".experts.gate_up_proj" in n for n in names)
    else:
        expert = "model.layers.1.mlp.down_proj"
    if method in ("gptq", "rtn"):
        assert {f"{expert}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx")} <= names
        assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
        assert qc["desc_act"] is False and qc["bits"] == stage.bits
        assert qc["sym"] is (method == "gptq")
    elif method == "awq":
        assert {f"{expert}.{t}" for t in ("qweight", "qzeros", "scales")} <= names
        assert qc == {**qc, "quant_method": "awq", "version": "gemm", "zero_point": True, "bits": 4}
    else:
        assert {f"{expert}.weight", f"{expert}.weight.absmax",
                f"{expert}.weight.quant_state.bitsandbytes__nf4"} <= names
        assert qc["bnb_4bit_quant_type"] == "nf4" and qc["load_in_4bit"] is True
    assert f"{expert}.weight" not in names or method == "nf4"
    assert (out / "quantize_report.json").is_file() and (out / "tokenizer.json").is_file()
    assert report.metrics()["quantized_matrices"] > 0

    loaded = load_quantized_model(out)
    ids = torch.randint(0, 4096, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, in_memory(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    assert not list(tmp_path.glob(".out-*")), "no temporary directory left behind"


def test_load_model_dispatches_to_the_quantized_loader(family_dirs, tmp_path):
    out = tmp_path / "rtn"
    quantize_model(family_dirs["llama"], QuantizeStage(method="rtn", group_size=32), CAL, out,
                   show_progress=False)
    model = load_model(out)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "DequantLinear"


@pytest.mark.parametrize("update,match", [
    ({"group_size": 48}, r"group_size=48 does not divide the 64 inputs of model\.layers\.0"),
    ({"method": "awq", "group_size": -1}, "AWQ gemm format needs a group size"),
    ({"keep_16bit": ["embeddings", "lm_head"]}, "keep_16bit must include router"),
    ({"keep_16bit": ["router", "embeddings", "lm_head", "experts"]}, "unknown parts"),
    ({"method": "rtn", "act_order": True}, "act_order applies to method gptq"),
])
def test_bad_options_fail_before_compute(family_dirs, tmp_path, update, match):
    stage = QuantizeStage(method="gptq", group_size=32).model_copy(update=update)
    with pytest.raises(CompressionError, match=match):
        quantize_model(family_dirs["qwen3_moe"], stage, CAL, tmp_path / "out",
                       show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_3bit_gptq_needs_32_aligned_shapes(tmp_path, tiny_demo):
    d = tmp_path / "odd"
    save_model(build_random_model("llama", hidden_size=48, intermediate_size=24), None, d)
    stage = QuantizeStage(method="gptq", bits=3, group_size=-1)
    with pytest.raises(CompressionError, match="packs 3-bit codes in runs of 32"):
        quantize_model(d, stage, CAL, tmp_path / "out", show_progress=False)


def test_existing_output_and_crash_leave_no_partial_artifact(family_dirs, tmp_path):
    stage = QuantizeStage(method="rtn", group_size=32)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ArtifactError, match="already exists"):
        quantize_model(family_dirs["llama"], stage, CAL, tmp_path / "taken", show_progress=False)

    def crash(i, layer, q):
        if i == 1:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        quantize_model(family_dirs["llama"], stage, CAL, tmp_path / "out", observer=crash,
                       show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
