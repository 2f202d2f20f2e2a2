import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.conftest import build_random_model
from thresher.models import get_adapter, save_model
from thresher.models.checkpoint import (
    CheckpointReader,
    CheckpointWriter,
    canonical_layer_state,
    read_layer_state,
)
from thresher.models.random_init import DENSE_FAMILIES, MOE_FAMILIES


def _keys(path):
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            keys |= set(h.keys())
    return keys


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_save_reload_identical_logits(family, tmp_path):
    model = build_random_model(family)
    save_model(model, None, tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_saved_keys_are_hub_canonical(family, tmp_path):
    model = build_random_model(family)
    ad = get_adapter(model.config)
    save_model(model, None, tmp_path)
    keys = _keys(tmp_path)
    assert not any("gate_up_proj" in k for k in keys), "fused expert tensors must not be written"
    for e in range(8):
        for proj in ("gate", "up", "down"):
            assert ad.disk_expert_key(0, e, proj) + ".weight" in keys
    assert ad.disk_router_key(1) + ".weight" in keys
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_layer_state_round_trip(family, tmp_path):
    model = build_random_model(family)
    ad = get_adapter(model.config)
    save_model(model, None, tmp_path)
    reader = CheckpointReader(tmp_path)
    layer = ad.layers(model)[1]
    state = read_layer_state(reader, ad, 1, ad.num_experts(model.config))
    assert set(state) == set(layer.state_dict())
    for k, v in layer.state_dict().items():
        assert torch.equal(state[k], v), k
    canon = canonical_layer_state(ad, 1, layer.state_dict())
    assert set(canon) == {k for k in reader.tensor_names() if k.startswith("model.layers.1.")}


def test_writer_shards_and_indexes(tmp_path):
    model = build_random_model("qwen3_moe")
    ad = get_adapter(model.config)
    writer = CheckpointWriter(tmp_path, max_shard_bytes=50_000)
    for i, layer in enumerate(ad.layers(model)):
        writer.add(canonical_layer_state(ad, i, layer.state_dict()))
    writer.add({"model.embed_tokens.weight": model.model.embed_tokens.weight,
                "model.norm.weight": model.model.norm.weight, "lm_head.weight": model.lm_head.weight})
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    model.config.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_streamed_shards_read_back_exactly_in_every_dtype(tmp_path):
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=g).half(), "i32": torch.randint(-9, 9, (4, 3)),
        "u8": torch.randint(0, 255, (5,), dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "i64": torch.arange(6).reshape(2, 3), "empty": torch.empty(0, 4),
        "slice": torch.randn(6, 6, generator=g)[:, 1:4],  # non-contiguous input
    }
    writer = CheckpointWriter(tmp_path)
    writer.add(tensors)
    writer.close()
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(tensors) and not list(tmp_path.glob("*.data"))
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
