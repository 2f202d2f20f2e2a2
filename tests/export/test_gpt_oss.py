"""GGUF export of gpt-oss under llama.cpp's ``gpt-oss`` architecture: its tensor names (sinks,
router and expert biases, gate and up deinterleaved from the fused hub tensor), the sliding
window and YaRN keys, llama.cpp's logits against thresher's for the base, a pruned and a 4-bit
variant, and the 4-bit variant's dequantized (fused hub-layout) checkpoint exported."""

import gguf
import pytest
import torch

from tests.conftest import CALIBRATION_FILE, build_random_model
from tests.export.test_glm4_moe import _llama_logits, _reference, needs_llama
from thresher.compress.api import quantize_model
from thresher.export import dequantize_gguf, export_gguf
from thresher.models import load_model, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage, QuantizeStage

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, tiny_tokenizer):
    model = build_random_model("gpt_oss", vocab_size=len(tiny_tokenizer), intermediate_size=64)
    path = tmp_path_factory.mktemp("gpt_oss") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_names_and_metadata_are_llama_cpps(gpt_oss, tmp_path):
    model, base = gpt_oss
    export_gguf(base, tmp_path / "f.gguf", "f32", show_progress=False)
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert _field(reader, "general.architecture") == "gpt-oss"
    expected = {"gpt-oss.expert_count": 8, "gpt-oss.expert_used_count": 2,
                "gpt-oss.attention.sliding_window": 4, "gpt-oss.block_count": 2,
                "gpt-oss.expert_feed_forward_length": 64,
                "gpt-oss.rope.scaling.original_context_length": 64}
    assert {k: _field(reader, k) for k in expected} == expected
    assert _field(reader, "gpt-oss.rope.scaling.type") == "yarn"
    assert _field(reader, "gpt-oss.rope.scaling.factor") == pytest.approx(8.0)
    assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias",
            "blk.0.ffn_up_exps.bias", "blk.0.ffn_down_exps.bias", "blk.1.post_attention_norm.weight",
            "blk.1.attn_output.bias"} <= set(tensors)
    # gate and up: the even and odd columns of the fused hub tensor, as [E, I, H]
    experts = model.model.layers[1].mlp.experts
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    got = torch.from_numpy(gate.data.copy()).reshape(8, 64, model.config.hidden_size)
    torch.testing.assert_close(got, experts.gate_up_proj.data[:, :, 0::2].transpose(1, 2))
    # every checkpoint tensor comes back from the file unchanged, in the hub's fused layout
    back = dequantize_gguf(tmp_path / "f.gguf", base, tmp_path / "back")
    a, b = CheckpointReader(base), CheckpointReader(back)
    assert sorted(a.tensor_names()) == sorted(b.tensor_names())
    for key in a.tensor_names():
        assert torch.equal(a.get(key).float(), b.get(key).float()), key


@needs_llama
@pytest.mark.parametrize(("variant", "gguf_type", "bound"), [
    ("base", "f32", 1e-4), ("reap50", "f32", 1e-4), ("base", "f16", 2e-3),
    ("gptq4", "q4_1", 2e-3)])
def test_llama_cpp_computes_thresher_logits(gpt_oss, tmp_path, tiny_tokenizer, variant, gguf_type,
                                            bound):
    """llama.cpp's gpt-oss graph (sinks, sliding-window layers over a 24-token prompt, biased
    router, expert biases, clamped SwiGLU, YaRN) gives thresher's logits."""
    _, base = gpt_oss
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


def test_importance_matrix_covers_every_gpt_oss_matrix(gpt_oss, tmp_path):
    """The imatrix reaches the deinterleaved gate and up and the clamped SwiGLU's output (the
    down projections' input), and weights an importance-aware export."""
    from thresher.export import compute_importance, gguf_importance

    _, base = gpt_oss
    importance = compute_importance(base, CAL, show_progress=False)
    rows = gguf_importance(base, importance)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                 "blk.1.ffn_down_exps.weight", "blk.1.attn_q.weight"):
        assert any(v is not None for v in rows[name]), name
    result = export_gguf(base, tmp_path / "q.gguf", "q4_0", importance=importance,
                         show_progress=False)
    assert result.imatrix and result.types["blk.0.ffn_up_exps.weight"] == "Q4_0"


@pytest.fixture(scope="module")
def gptq4(gpt_oss, tmp_path_factory):
    """A 4-bit GPTQ artifact of the base model, and its dequantized (hub-layout) checkpoint."""
    from thresher.models.quantized import write_dequantized

    _, base = gpt_oss
    root = tmp_path_factory.mktemp("gpt_oss_gptq")
    quantize_model(base, QuantizeStage(method="gptq", group_size=32, sym=False), CAL,
                   root / "gptq", show_progress=False)
    return root / "gptq", write_dequantized(root / "gptq", root / "dequantized")


def test_gptq_codes_handed_to_q4_1_are_the_artifacts_weights(gptq4, tmp_path):
    """Without llama.cpp: the Q4_1 matrices of a 4-bit gpt-oss hand-off dequantize to the GPTQ
    artifact's own weights, and its expert biases travel as they are."""
    source, dequantized = gptq4
    export_gguf(source, tmp_path / "q.gguf", "q4_1", show_progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    plain = CheckpointReader(dequantized)
    experts = "model.layers.1.mlp.experts."
    expected = {
        "blk.1.attn_v.weight": plain.get("model.layers.1.self_attn.v_proj.weight"),
        "blk.1.ffn_up_exps.weight": plain.get(experts + "gate_up_proj")[:, :, 1::2].transpose(1, 2),
        "blk.1.ffn_down_exps.bias": plain.get(experts + "down_proj_bias")}
    for name, want in expected.items():
        t = tensors[name]
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        torch.testing.assert_close(got.reshape(want.shape), want.float(), rtol=0, atol=1e-3)
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    assert tensors["blk.1.ffn_down_exps.bias"].tensor_type == gguf.GGMLQuantizationType.F32


def test_dequantized_checkpoint_exports_and_comes_back_fused(gptq4, tmp_path):
    """A dequantized 4-bit artifact (the input of GGUF requantization) exports like a hub
    checkpoint, and the file's weights come back as the same fused hub tensors."""
    _, dequantized = gptq4
    export_gguf(dequantized, tmp_path / "f.gguf", "f32", show_progress=False)
    back = dequantize_gguf(tmp_path / "f.gguf", dequantized, tmp_path / "back")
    a, b = CheckpointReader(dequantized), CheckpointReader(back)
    assert sorted(a.tensor_names()) == sorted(b.tensor_names())
    assert "model.layers.0.mlp.experts.gate_up_proj" in a.tensor_names()
    for key in a.tensor_names():
        assert torch.equal(a.get(key).float(), b.get(key).float()), key


def test_mxfp4_checkpoint_exports_its_dequantized_experts(gpt_oss, tmp_path, tiny_tokenizer):
    """A hub-layout MXFP4 checkpoint exports as the model thresher loads from it."""
    from tests.models.test_gpt_oss import _write_mxfp4

    _, base = gpt_oss
    rounded = _write_mxfp4(base, tmp_path / "mxfp4")
    tiny_tokenizer.save_pretrained(tmp_path / "mxfp4")
    export_gguf(tmp_path / "mxfp4", tmp_path / "f.gguf", "f32", show_progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "f.gguf").tensors}
    down = torch.from_numpy(tensors["blk.1.ffn_down_exps.weight"].data.copy())
    want = rounded["model.layers.1.mlp.experts.down_proj"].transpose(1, 2)
    torch.testing.assert_close(down.reshape(want.shape), want)
    back = dequantize_gguf(tmp_path / "f.gguf", tmp_path / "mxfp4", tmp_path / "back")
    ids = torch.randint(0, len(tiny_tokenizer), (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(load_model(back)(input_ids=ids).logits,
                                   load_model(tmp_path / "mxfp4")(input_ids=ids).logits)
