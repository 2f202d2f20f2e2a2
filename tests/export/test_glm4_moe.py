"""GGUF export of GLM-4.5 under llama.cpp's ``glm4moe`` architecture: its tensor names and routing
metadata, and llama.cpp's logits against thresher's for the base, a pruned and a 4-bit variant."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.compress.api import quantize_model
from thresher.export import dequantize_gguf, export_gguf
from thresher.export.llama_runtime import INSTALL_HINT, LLAMA_CPP_AVAILABLE
from thresher.models import load_model, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage, QuantizeStage

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)
needs_llama = pytest.mark.skipif(not LLAMA_CPP_AVAILABLE, reason=INSTALL_HINT)


@pytest.fixture(scope="module")
def glm(tmp_path_factory, tiny_tokenizer):
    model = build_random_model("glm4_moe", vocab_size=len(tiny_tokenizer), intermediate_size=64)
    path = tmp_path_factory.mktemp("glm") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_names_and_routing_metadata_are_llama_cpps(glm, tmp_path):
    _, base = glm
    export_gguf(base, tmp_path / "f.gguf", "f32", show_progress=False)
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    names = {t.name for t in reader.tensors}
    assert _field(reader, "general.architecture") == "glm4moe"
    expected = {"glm4moe.leading_dense_block_count": 1, "glm4moe.expert_shared_count": 1,
                "glm4moe.expert_count": 8, "glm4moe.expert_used_count": 2,
                "glm4moe.expert_gating_func": 2, "glm4moe.expert_weights_norm": True,
                "glm4moe.expert_group_count": 2, "glm4moe.expert_group_used_count": 1,
                "glm4moe.rope.dimension_count": 8, "glm4moe.nextn_predict_layers": 0,
                "glm4moe.block_count": 3}
    assert {k: _field(reader, k) for k in expected} == expected
    assert _field(reader, "glm4moe.expert_weights_scale") == pytest.approx(2.5)
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.0.post_attention_norm.weight",
            "blk.1.exp_probs_b.bias", "blk.1.ffn_gate_inp.weight", "blk.1.ffn_up_exps.weight",
            "blk.1.ffn_gate_shexp.weight", "blk.2.ffn_down_shexp.weight", "blk.1.attn_q.bias",
            "blk.1.attn_k_norm.weight"} <= names
    assert not any(n.startswith("blk.0.ffn_gate_inp") or ".ffn_norm." in n for n in names)
    # every checkpoint tensor comes back from the file unchanged
    back = dequantize_gguf(tmp_path / "f.gguf", base, tmp_path / "back")
    a, b = CheckpointReader(base), CheckpointReader(back)
    for key in a.tensor_names():
        assert torch.equal(a.get(key).float(), b.get(key).float()), key


_LLAMA_SCRIPT = """
import sys, torch
from thresher.export.llama_runtime import LlamaCppModel
llama = LlamaCppModel(sys.argv[1], n_ctx=32)
torch.save(llama.logits(torch.load(sys.argv[2])), sys.argv[3])
llama.close()
"""


def _llama_logits(path, ids, tmp_path):
    """llama.cpp's logits in a child process, so that a llama.cpp abort (a GGML_ASSERT on a
    tensor type its CPU graph does not take) fails this test instead of ending the run."""
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run([sys.executable, "-c", _LLAMA_SCRIPT, str(path), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, (f"llama.cpp exited with {done.returncode} on {path}",
                                  done.stderr[-2000:])
    return torch.load(tmp_path / "logits.pt")


def _reference(source: Path, gguf_path: Path):
    """The model whose logits llama.cpp's must match: ``source``, and for a GPTQ hand-off the
    artifact with the embeddings and head the export quantized (Q4_1 / Q8_0, about 10% of a
    logit's spread on these random models) taken from the file; its other matrices are the
    artifact's codes (``test_gptq_codes_handed_to_q4_1_are_the_artifacts_weights``)."""
    model = load_model(source)
    if "quantization_config" not in (source / "config.json").read_text():
        return model
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    for name, param in (("token_embd.weight", model.get_input_embeddings().weight),
                        ("output.weight", model.get_output_embeddings().weight)):
        t = tensors.get(name, tensors["token_embd.weight"])  # tied: one matrix
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(param.shape)
        param.data.copy_(torch.from_numpy(values.copy()))
    return model


@needs_llama
@pytest.mark.parametrize(("variant", "gguf_type", "bound"), [
    ("base", "f32", 1e-4), ("reap50", "f32", 1e-4), ("gptq4", "q4_1", 2e-3)])
def test_llama_cpp_computes_thresher_logits(glm, tmp_path, tiny_tokenizer, variant, gguf_type,
                                            bound):
    """llama.cpp's glm4moe graph (sigmoid routing with the correction bias and groups, shared
    experts, dense first layer, partial rotary) gives thresher's logits: F32 files to float
    rounding, the GPTQ codes handed to Q4_1 as they are to within llama.cpp's 8-bit activation
    rounding."""
    _, base = glm
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


def test_gptq_codes_handed_to_q4_1_are_the_artifacts_weights(glm, tmp_path):
    """Without llama.cpp: every Q4_1 matrix of the hand-off file dequantizes to the GPTQ
    artifact's own dequantized weights (experts, shared experts, the dense layer, attention)."""
    from thresher.models.quantized import write_dequantized

    _, base = glm
    source = tmp_path / "gptq"
    quantize_model(base, QuantizeStage(method="gptq", group_size=32, sym=False), CAL, source,
                   show_progress=False)
    export_gguf(source, tmp_path / "q.gguf", "q4_1", show_progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    plain = CheckpointReader(write_dequantized(source, tmp_path / "dequantized"))
    expected = {
        "blk.0.ffn_up.weight": plain.get("model.layers.0.mlp.up_proj.weight"),
        "blk.1.attn_v.weight": plain.get("model.layers.1.self_attn.v_proj.weight"),
        "blk.2.ffn_gate_shexp.weight": plain.get("model.layers.2.mlp.shared_experts.gate_proj"
                                                 ".weight"),
        "blk.1.ffn_down_exps.weight": torch.stack([
            plain.get(f"model.layers.1.mlp.experts.{e}.down_proj.weight") for e in range(8)])}
    for name, want in expected.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1, name
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        torch.testing.assert_close(got.reshape(want.shape), want.float(), rtol=0, atol=1e-3)
