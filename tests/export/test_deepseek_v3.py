"""GGUF export of DeepSeek-V3 under llama.cpp's ``deepseek2`` architecture: its MLA tensors (kv_b
split into ``attn_k_b``/``attn_v_b``) and metadata, and llama.cpp's logits against thresher's for
the base, a pruned and a 4-bit variant."""

import gguf
import pytest
import torch

from tests.conftest import build_random_model
from tests.export.test_glm4_moe import CAL, _field, _llama_logits, _reference, needs_llama
from thresher.compress.api import quantize_model
from thresher.errors import ExportError
from thresher.export import dequantize_gguf, export_gguf
from thresher.models import save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.prune.api import prune_model
from thresher.recipe import PruneStage, QuantizeStage


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory, tiny_tokenizer):
    model = build_random_model("deepseek_v3", vocab_size=len(tiny_tokenizer), intermediate_size=64)
    path = tmp_path_factory.mktemp("dsv3") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


def test_mla_tensors_and_metadata_are_llama_cpps(dsv3, tmp_path):
    model, base = dsv3
    config = model.config
    export_gguf(base, tmp_path / "f.gguf", "f32", show_progress=False)
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    assert _field(reader, "general.architecture") == "deepseek2"
    expected = {"deepseek2.attention.q_lora_rank": 32, "deepseek2.attention.kv_lora_rank": 32,
                "deepseek2.attention.head_count_kv": 1, "deepseek2.attention.key_length": 48,
                "deepseek2.attention.value_length": 32, "deepseek2.attention.key_length_mla": 32,
                "deepseek2.attention.value_length_mla": 16, "deepseek2.rope.dimension_count": 16,
                "deepseek2.leading_dense_block_count": 1, "deepseek2.expert_shared_count": 1,
                "deepseek2.expert_gating_func": 2, "deepseek2.expert_group_count": 2,
                "deepseek2.rope.scaling.original_context_length": 128}
    assert {k: _field(reader, k) for k in expected} == expected
    assert _field(reader, "deepseek2.rope.scaling.yarn_log_multiplier") == pytest.approx(0.1)
    tensors = {t.name: t for t in reader.tensors}
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    assert tuple(tensors["blk.1.attn_k_b.weight"].shape) == (16, rank, heads)  # ggml order
    assert tuple(tensors["blk.1.attn_v_b.weight"].shape) == (rank, 16, heads)
    assert {"blk.0.attn_q_a.weight", "blk.0.attn_q_a_norm.weight", "blk.2.attn_q_b.weight",
            "blk.1.attn_kv_a_mqa.weight", "blk.1.attn_kv_a_norm.weight", "blk.0.ffn_down.weight",
            "blk.1.exp_probs_b.bias", "blk.2.ffn_up_shexp.weight"} <= set(tensors)
    assert not any(".attn_kv_b." in n or ".attn_q." in n for n in tensors)
    # every checkpoint tensor comes back from the file unchanged (kv_b joined from its parts)
    back = dequantize_gguf(tmp_path / "f.gguf", base, tmp_path / "back")
    a, b = CheckpointReader(base), CheckpointReader(back)
    for key in a.tensor_names():
        assert torch.equal(a.get(key).float(), b.get(key).float()), key


def test_half_rotary_config_is_refused(tmp_path, tiny_tokenizer):
    model = build_random_model("deepseek_v3", vocab_size=len(tiny_tokenizer),
                               rope_interleave=False)
    save_model(model, tiny_tokenizer, tmp_path / "m")
    with pytest.raises(ExportError, match="rope_interleave"):
        export_gguf(tmp_path / "m", tmp_path / "f.gguf", "f32", show_progress=False)


@needs_llama
@pytest.mark.parametrize(("variant", "gguf_type", "bound"), [
    ("base", "f32", 1e-4), ("base", "f16", 2e-3), ("reap50", "f32", 1e-4),
    ("kimi", "f32", 1e-4), ("gptq4", "q4_1", 2e-3)])
def test_llama_cpp_computes_thresher_logits(dsv3, tmp_path, tiny_tokenizer, variant, gguf_type,
                                            bound):
    """llama.cpp's deepseek2 graph (absorbed MLA, yarn, sigmoid routing with the correction bias
    and groups, shared experts, dense first layer) gives thresher's logits: F32 files to float
    rounding, F16 to half rounding; the GPTQ codes handed to Q4_1 (kv_b dequantized into F32
    k_b/v_b) to within llama.cpp's 8-bit activation rounding."""
    _, base = dsv3
    source = base
    if variant == "reap50":
        source = tmp_path / "pruned"
        prune_model(base, PruneStage(method="reap", ratio=0.5), CAL, source, show_progress=False)
    elif variant == "kimi":  # Kimi-K2's routing and yarn: one group, yarn betas 1 and 1
        source = tmp_path / "kimi"
        rope = dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, beta_fast=1, beta_slow=1,
                    original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
        save_model(build_random_model("deepseek_v3", vocab_size=len(tiny_tokenizer), n_group=1,
                                      rope_parameters=rope, routed_scaling_factor=2.827),
                   tiny_tokenizer, source)
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


def test_gptq_hand_off_keeps_the_artifacts_latent_projections(dsv3, tmp_path):
    """Without llama.cpp: the Q4_1 hand-off file's MLA matrices dequantize to the GPTQ artifact's
    own weights, and its k_b/v_b are the artifact's dequantized kv_b split per head."""
    from thresher.models.quantized import write_dequantized

    model, base = dsv3
    source = tmp_path / "gptq"
    quantize_model(base, QuantizeStage(method="gptq", group_size=32, sym=False), CAL, source,
                   show_progress=False)
    export_gguf(source, tmp_path / "q.gguf", "q4_1", show_progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    plain = CheckpointReader(write_dequantized(source, tmp_path / "dequantized"))

    def back(name):
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())

    for name, key in (("blk.1.attn_q_a", "q_a_proj"), ("blk.1.attn_q_b", "q_b_proj"),
                      ("blk.2.attn_kv_a_mqa", "kv_a_proj_with_mqa"), ("blk.0.attn_output", "o_proj")):
        want = plain.get(f"model.layers.{name[4]}.self_attn.{key}.weight").float()
        assert tensors[name + ".weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
        torch.testing.assert_close(back(name + ".weight").reshape(want.shape), want, rtol=0,
                                   atol=1e-3)
    heads, nope = model.config.num_attention_heads, model.config.qk_nope_head_dim
    kv_b = plain.get("model.layers.1.self_attn.kv_b_proj.weight").float().view(heads, -1, 32)
    k_b, v_b = back("blk.1.attn_k_b.weight"), back("blk.1.attn_v_b.weight")
    torch.testing.assert_close(k_b.reshape(heads, 32, nope), kv_b[:, :nope].transpose(1, 2))
    torch.testing.assert_close(v_b.reshape(heads, -1, 32), kv_b[:, nope:])
