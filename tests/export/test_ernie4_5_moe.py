"""GGUF export of ERNIE-4.5-MoE under llama.cpp's ``ernie4_5-moe`` architecture: its tensor names
and MoE layout metadata, and llama.cpp's logits against thresher's for the base, a pruned and a
4-bit variant."""

import gguf
import pytest
import torch

from tests.conftest import build_random_model
from tests.export.test_glm4_moe import CAL, _field, _llama_logits, _reference, needs_llama
from thresher.compress.api import quantize_model
from thresher.export import dequantize_gguf, export_gguf
from thresher.models import save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.prune.api import prune_model
from thresher.recipe import PruneStage, QuantizeStage


@pytest.fixture(scope="module")
def ernie(tmp_path_factory, tiny_tokenizer):
    model = build_random_model("ernie4_5_moe", vocab_size=len(tiny_tokenizer),
                               intermediate_size=64)
    path = tmp_path_factory.mktemp("ernie") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


def test_names_and_layout_metadata_are_llama_cpps(ernie, tmp_path):
    _, base = ernie
    export_gguf(base, tmp_path / "f.gguf", "f32", show_progress=False)
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert _field(reader, "general.architecture") == "ernie4_5-moe"
    expected = {"ernie4_5-moe.leading_dense_block_count": 1,
                "ernie4_5-moe.interleave_moe_layer_step": 1,
                "ernie4_5-moe.expert_shared_count": 2, "ernie4_5-moe.expert_count": 8,
                "ernie4_5-moe.expert_used_count": 2, "ernie4_5-moe.expert_feed_forward_length": 64,
                "ernie4_5-moe.expert_shared_feed_forward_length": 128,
                "ernie4_5-moe.block_count": 3}
    assert {k: _field(reader, k) for k in expected} == expected
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.1.ffn_norm.weight",
            "blk.1.exp_probs_b.bias", "blk.1.ffn_gate_inp.weight", "blk.1.ffn_up_exps.weight",
            "blk.1.ffn_gate_shexp.weight", "blk.2.ffn_down_shexp.weight"} <= set(tensors)
    assert list(tensors["blk.1.exp_probs_b.bias"].shape) == [8]  # [1, E] in the checkpoint
    assert not any(n.startswith("blk.0.ffn_gate_inp") for n in tensors)
    # every checkpoint tensor comes back from the file unchanged
    back = dequantize_gguf(tmp_path / "f.gguf", base, tmp_path / "back")
    a, b = CheckpointReader(base), CheckpointReader(back)
    for key in a.tensor_names():
        assert torch.equal(a.get(key).float(), b.get(key).float()), key


@needs_llama
@pytest.mark.parametrize(("variant", "gguf_type", "bound"), [
    ("base", "f32", 2e-4), ("base", "f16", 2e-3), ("reap50", "f32", 1e-4),
    ("gptq4", "q4_1", 2e-3)])
def test_llama_cpp_computes_thresher_logits(ernie, tmp_path, tiny_tokenizer, variant, gguf_type,
                                            bound):
    """llama.cpp's ernie4_5-moe graph (softmax routing selecting with ``exp_probs_b``, shared
    experts, dense first layer, adjacent-pair rotary) gives thresher's logits: F32 files to
    float rounding (the base's mean |difference| is 9e-5: one near-tied choice of experts), F16
    to half rounding, the GPTQ codes handed to Q4_1 to within llama.cpp's 8-bit activation
    rounding."""
    _, base = ernie
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


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0", "gptq4"])
def test_selection_bias_is_f32_in_every_file_type(ernie, tmp_path, gguf_type):
    """The [1, E] ``moe_statics`` bias is a vector in llama.cpp, kept in F32 as its converter
    keeps vectors: an F16 one aborts llama.cpp's CPU add, and rows of E values are no Q8_0
    blocks (the export used to refuse Q8_0 for 8 experts)."""
    _, base = ernie
    source = base
    if gguf_type == "gptq4":  # the hand-off writes matrices it does not hand off in F16
        source = tmp_path / "gptq"
        quantize_model(base, QuantizeStage(method="gptq", group_size=32, sym=False), CAL, source,
                       show_progress=False)
    export_gguf(source, tmp_path / "f.gguf", "q4_1" if gguf_type == "gptq4" else gguf_type,
                show_progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "f.gguf").tensors}
    assert tensors["blk.1.exp_probs_b.bias"].tensor_type == gguf.GGMLQuantizationType.F32


def test_interleaved_moe_layers_are_refused_with_the_reason(tmp_path, tiny_tokenizer):
    """``moe_layer_interval`` 2: llama.cpp's loader wants experts in every layer after the
    leading dense ones (a file written to its graph's rule does not load), so the export says
    so instead of writing a file that fails there."""
    from thresher.errors import ExportError

    model = build_random_model("ernie4_5_moe", num_layers=4, vocab_size=len(tiny_tokenizer),
                               moe_layer_interval=2)
    save_model(model, tiny_tokenizer, tmp_path / "m")
    with pytest.raises(ExportError, match="every 2 layers.*loader"):
        export_gguf(tmp_path / "m", tmp_path / "f.gguf", "f32", show_progress=False)
    assert not (tmp_path / "f.gguf").exists()
