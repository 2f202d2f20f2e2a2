"""GGUF export of Qwen3.5-MoE under llama.cpp's ``qwen35moe`` architecture: the Gated DeltaNet's
tensors converted as llama.cpp's converter does (value heads tiled, ``ssm_a = -exp(A_log)``,
zero-centered norms plus one), the hybrid metadata, a lossless round trip, and llama.cpp's logits
against thresher's for the base, a pruned and a 4-bit variant."""

import gguf
import numpy as np
import pytest
import torch

from tests.conftest import build_random_model
from tests.export.test_glm4_moe import CAL, _field, _llama_logits, _reference, needs_llama
from thresher.compress.api import quantize_model
from thresher.export import dequantize_gguf, export_gguf
from thresher.export.gguf_convert import VHeads
from thresher.models import save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.prune.api import prune_model
from thresher.recipe import PruneStage, QuantizeStage


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, tiny_tokenizer):
    # value heads 32 wide: whole Q4_1 blocks, so out_proj's columns reorder in the hand-off;
    # keys as wide, since llama.cpp's graph takes one head width for both (as the hub models have)
    model = build_random_model("qwen3_5_moe", vocab_size=len(tiny_tokenizer),
                               linear_key_head_dim=32, linear_value_head_dim=32)
    path = tmp_path_factory.mktemp("qwen35") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


def test_value_heads_go_from_grouped_to_tiled():
    heads = VHeads(num_k=2, per_k=3, head_dim=1)
    assert heads.order().tolist() == [0, 3, 1, 4, 2, 5]  # k0v0 k1v0 k0v1 k1v1 k0v2 k1v2
    x = np.arange(8 * 5).reshape(8, 5)
    shifted = VHeads(2, 2, 2, start=0)
    assert np.array_equal(shifted.permute(shifted.permute(x, 0), 0, inverse=True), x)


def test_names_conversions_and_hybrid_metadata_are_llama_cpps(qwen35, tmp_path):
    model, base = qwen35
    export_gguf(base, tmp_path / "f.gguf", "f32", show_progress=False)
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert _field(reader, "general.architecture") == "qwen35moe"
    expected = {"qwen35moe.ssm.conv_kernel": 4, "qwen35moe.ssm.state_size": 32,
                "qwen35moe.ssm.group_count": 2, "qwen35moe.ssm.time_step_rank": 4,
                "qwen35moe.ssm.inner_size": 128, "qwen35moe.full_attention_interval": 2,
                "qwen35moe.rope.dimension_count": 8, "qwen35moe.expert_count": 8,
                "qwen35moe.expert_used_count": 2, "qwen35moe.attention.key_length": 32,
                "qwen35moe.expert_shared_feed_forward_length": 64}
    assert {k: _field(reader, k) for k in expected} == expected
    assert _field(reader, "qwen35moe.rope.dimension_sections") == [2, 1, 1, 0]
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias",
            "blk.0.ssm_conv1d.weight", "blk.0.ssm_norm.weight", "blk.0.ssm_out.weight",
            "blk.0.ssm_alpha.weight", "blk.0.ssm_beta.weight", "blk.1.attn_q.weight",
            "blk.1.attn_q_norm.weight", "blk.1.post_attention_norm.weight",
            "blk.1.ffn_gate_inp_shexp.weight", "blk.3.ffn_down_exps.weight"} <= set(tensors)
    assert not any(n.startswith("blk.0.attn_q.") for n in tensors)
    layer = model.model.layers[0].linear_attn
    a_log = layer.A_log.detach().numpy()
    tiled = VHeads(2, 2, 1).order()
    np.testing.assert_allclose(tensors["blk.0.ssm_a"].data, -np.exp(a_log[tiled]), rtol=1e-6)
    norm = model.model.layers[1].input_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(tensors["blk.1.attn_norm.weight"].data, norm + 1, rtol=1e-6)
    np.testing.assert_array_equal(tensors["blk.0.ssm_norm.weight"].data,
                                  layer.norm.weight.detach().numpy())
    # every checkpoint tensor comes back from the file unchanged
    back = dequantize_gguf(tmp_path / "f.gguf", base, tmp_path / "back")
    a, b = CheckpointReader(base), CheckpointReader(back)
    for key in a.tensor_names():
        torch.testing.assert_close(b.get(key).float(), a.get(key).float(), rtol=1e-6,
                                   atol=1e-7, msg=key)


@needs_llama
@pytest.mark.parametrize(("variant", "gguf_type", "bound"), [
    ("base", "f32", 5e-4), ("base", "f16", 1.5e-3), ("reap50", "f32", 5e-4),
    ("gptq4", "q4_1", 1.5e-2)])
def test_llama_cpp_computes_thresher_logits(qwen35, tmp_path, tiny_tokenizer, variant, gguf_type,
                                            bound):
    """llama.cpp's qwen35moe graph (Gated DeltaNet recurrence, gated attention, renormalized
    softmax routing, gated shared expert) gives thresher's logits: F32 files to float rounding
    carried along the recurrence (mean |difference| 2e-4: transformers runs the prefill's delta
    rule chunked, llama.cpp token by token), F16 to its rounding, the GPTQ codes handed to Q4_1
    to within llama.cpp's 8-bit activation rounding, which the recurrence carries too (7.8e-3
    measured, 2.4% of the logits' spread; a Q8_0 file differs from its own weights as much)."""
    _, base = qwen35
    source = base
    if variant == "reap50":
        source = tmp_path / "pruned"
        prune_model(base, PruneStage(method="reap", ratio=0.5), CAL, source, show_progress=False)
    elif variant == "gptq4":
        source = tmp_path / "gptq"
        quantize_model(base, QuantizeStage(method="gptq", group_size=32, sym=False), CAL, source,
                       show_progress=False)
    export_gguf(source, tmp_path / "f.gguf", gguf_type, show_progress=False)
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _reference(source, tmp_path / "f.gguf")(input_ids=ids).logits
    got = _llama_logits(tmp_path / "f.gguf", ids, tmp_path)
    assert (got - want).abs().mean() < bound
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_gptq_codes_hand_off_to_q4_1_with_value_heads_tiled(qwen35, tmp_path):
    """A GPTQ-4 g32 artifact's codes become the Q4_1 blocks: the DeltaNet's rows and out_proj's
    input columns move in whole blocks to llama.cpp's tiled value heads, and each tensor
    dequantizes to the artifact's weights so reordered."""
    from thresher.models.quantized import load_quantized_model

    _, base = qwen35
    source = tmp_path / "gptq"
    quantize_model(base, QuantizeStage(method="gptq", group_size=32, sym=False), CAL, source,
                   show_progress=False)
    export_gguf(source, tmp_path / "f.gguf", "q4_1", show_progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "f.gguf").tensors}
    layer = load_quantized_model(source).model.layers[0].linear_attn
    tiled = VHeads(2, 2, 32).order()
    qkv = layer.in_proj_qkv.weight_float().numpy()
    want = {"blk.0.ssm_out.weight": layer.out_proj.weight_float().numpy()[:, tiled],
            "blk.0.attn_gate.weight": layer.in_proj_z.weight_float().numpy()[tiled],
            "blk.0.attn_qkv.weight": np.concatenate([qkv[:128], qkv[128:][tiled]])}
    for name, w in want.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1, name
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        np.testing.assert_allclose(got, w, rtol=0, atol=2e-3, err_msg=name)


def test_the_hub_checkpoint_exports_as_its_text_model(qwen35, tmp_path, tiny_tokenizer):
    """From the multimodal hub layout (fused experts, vision tower, MTP block) the GGUF file is
    the one the text artifact gives, tensor for tensor."""
    from tests.models.test_qwen35 import write_hub_checkpoint

    model, base = qwen35
    hub = write_hub_checkpoint(model, tmp_path / "hub")
    tiny_tokenizer.save_pretrained(hub)
    export_gguf(hub, tmp_path / "hub.gguf", "f32", show_progress=False)
    export_gguf(base, tmp_path / "base.gguf", "f32", show_progress=False)
    got = {t.name: t for t in gguf.GGUFReader(tmp_path / "hub.gguf").tensors}
    want = {t.name: t for t in gguf.GGUFReader(tmp_path / "base.gguf").tensors}
    assert set(got) == set(want)
    for name, t in want.items():
        np.testing.assert_array_equal(got[name].data, t.data, err_msg=name)
