"""gpt-oss: the adapter's views of its transposed, interleaved experts, layer-by-layer evaluation
equal to transformers' forward (sinks, sliding-window layers shorter than the prompt, biases,
clamped SwiGLU), and MXFP4 checkpoints dequantized on load."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tests.conftest import build_random_model
from thresher.errors import CheckpointError
from thresher.models import get_adapter, load_model, mxfp4, save_model
from thresher.models.layerwise import LayerwiseModel


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    model = build_random_model("gpt_oss", num_layers=4)
    path = tmp_path_factory.mktemp("gpt_oss") / "base"
    save_model(model, None, path)
    return model, path


def layerwise_logits(path, ids):
    """thresher's own evaluation path: one decoder layer resident at a time."""
    lw = LayerwiseModel(path, torch.float32)
    lw.load_outer()
    hidden = lw.embed(ids)
    for i in range(lw.num_layers):
        lw.load_layer(i)
        hidden = lw.layer_forward(i, hidden)
        lw.release_layer(i)
    return lw.logits(hidden)


def test_expert_views_follow_the_interleaved_hub_layout(gpt_oss):
    model, _ = gpt_oss
    ad = get_adapter(model.config)
    layer = ad.layers(model)[1]
    experts = ad.experts(layer)
    inter, hidden = model.config.intermediate_size, model.config.hidden_size
    for e in (0, 5):
        view = ad.expert_view(layer, e)
        assert view.gate.shape == view.up.shape == (inter, hidden)
        assert view.down.shape == (hidden, inter)
        assert torch.equal(view.gate, experts.gate_up_proj[e][:, 0::2].t())
        assert torch.equal(view.up, experts.gate_up_proj[e][:, 1::2].t())
        assert view.down.data_ptr() == experts.down_proj[e].data_ptr()  # a view: writes land
    assert ad.disk_router_key(1) == "model.layers.1.mlp.router"


def test_checkpoint_keeps_the_hub_names(gpt_oss):
    model, path = gpt_oss
    keys = set(load_file(path / "model.safetensors"))
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias",
            "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.down_proj_bias",
            "model.layers.0.mlp.router.bias", "model.layers.0.self_attn.sinks"} <= keys
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2


@torch.no_grad()
def test_layerwise_and_loaded_models_give_transformers_logits(gpt_oss):
    """Prompts longer than the 4-token window: a wrong sliding mask, a missing sink or a wrong
    SwiGLU clamp changes the logits."""
    model, path = gpt_oss
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    torch.testing.assert_close(layerwise_logits(path, ids), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(load_model(path)(ids).logits, ref, rtol=1e-4, atol=1e-4)
    unwindowed = model.config.sliding_window
    try:  # the window matters at this length
        model.config.sliding_window = 64
        assert not torch.allclose(model(ids).logits, ref, atol=1e-3)
    finally:
        model.config.sliding_window = unwindowed


def test_mxfp4_dequantizes_as_transformers_does():
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(mxfp4.dequantize(blocks, scales, torch.float32), want)
    w = torch.randn(3, 64, 8)
    round_trip = mxfp4.dequantize(*mxfp4.quantize(w), torch.float32)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(round_trip), torch.float32), round_trip)


def _write_mxfp4(path, out):
    """``path``'s checkpoint with its experts in the hub's MXFP4 layout, and the model that
    layout holds (experts rounded to MXFP4)."""
    out.mkdir()
    tensors = load_file(path / "model.safetensors")
    rounded = dict(tensors)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(key))
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        rounded[key] = mxfp4.dequantize(blocks, scales, torch.float32)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    return rounded


@torch.no_grad()
def test_mxfp4_checkpoint_loads_dequantized(gpt_oss, tmp_path):
    model, path = gpt_oss
    rounded = _write_mxfp4(path, tmp_path / "mxfp4")
    reference = build_random_model("gpt_oss", num_layers=4)
    reference.load_state_dict(rounded, strict=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    ref = reference(ids).logits
    loaded = load_model(tmp_path / "mxfp4")
    assert getattr(loaded.config, "quantization_config", None) is None
    torch.testing.assert_close(loaded(ids).logits, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layerwise_logits(tmp_path / "mxfp4", ids), ref, rtol=1e-4, atol=1e-4)


def test_mxfp4_blocks_without_scales_are_named(gpt_oss, tmp_path):
    _, path = gpt_oss
    out = tmp_path / "broken"
    _write_mxfp4(path, out)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*down_proj_blocks.*"
                                              r"down_proj_scales"):
        load_model(out)
