"""GGUF export's K-quant mixes, importance matrix and the lossless GPTQ/AWQ hand-off to Q4_1, on
the tiny demo model (and a random Qwen3-MoE whose rows are whole K-quant super-blocks)."""

import gguf
import numpy as np
import pytest

from tests.conftest import build_random_model
from tests.export.conftest import CAL
from thresher.errors import ExportError
from thresher.export import compute_importance, export_gguf
from thresher.export.block_quants import quantize
from thresher.export.gguf import HANDOFF_GROUP
from thresher.formats.awq import unpack_awq
from thresher.formats.gptq import unpack_gptq
from thresher.models import save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.recipe import CalibrationConfig, QuantizeStage

QType = gguf.GGMLQuantizationType


def _tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def importance(tiny_demo):
    return compute_importance(tiny_demo, CAL, show_progress=False)


def test_k_quant_mixes_read_back(tiny_tokenizer, tmp_path):
    """Rows of 256 (the types each tensor takes are llama.cpp's own, checked against its
    quantizer in test_llama_cpp.py): the file type is recorded, and the Q4_K, Q6_K and Q3_K
    tensors read back near the source weights."""
    model = build_random_model("qwen3_moe", num_layers=8, hidden_size=256, head_dim=32,
                               num_attention_heads=8, vocab_size=len(tiny_tokenizer))
    save_model(model, tiny_tokenizer, tmp_path / "k")
    source = CheckpointReader(tmp_path / "k")
    for gguf_type, file_type in (("q4_k_m", gguf.LlamaFileType.MOSTLY_Q4_K_M),
                                 ("q3_k_m", gguf.LlamaFileType.MOSTLY_Q3_K_M)):
        out = tmp_path / f"{gguf_type}.gguf"
        types = export_gguf(tmp_path / "k", out, gguf_type, show_progress=False).types
        reader = gguf.GGUFReader(out)
        assert reader.fields["general.file_type"].contents() == file_type
        tensors = _tensors(out)
        for name, key in (("blk.2.attn_q.weight", "model.layers.2.self_attn.q_proj.weight"),
                          ("output.weight", "lm_head.weight")):
            got = gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)
            want = source.get(key).float().numpy()
            rel = np.linalg.norm(got - want) / np.linalg.norm(want)
            bound = {"Q3_K": 0.25, "Q4_K": 0.12, "Q6_K": 0.03}[types[name]]
            assert rel < bound, (gguf_type, name, rel)


def test_importance_matrix_covers_every_quantized_matrix(tiny_demo, importance):
    """Every matrix llama.cpp quantizes has statistics, except an expert no calibration token
    was routed to (as in llama.cpp's own imatrix): its three matrices are missing together, and
    the routed counts of each layer still add up to every token's two experts."""
    reader = CheckpointReader(tiny_demo)
    matrices = {k for k in reader.tensor_names() if len(reader.shape(k)) == 2}
    quantized = matrices - {"model.embed_tokens.weight"} - {
        f"model.layers.{i}.mlp.gate.weight" for i in range(4)} | {"lm_head.weight"}
    collected = set(importance.tokens)
    assert collected <= quantized
    windows = CAL.samples * CAL.seq_len
    assert importance.tokens["model.layers.0.self_attn.q_proj.weight"] == windows
    for layer in range(4):
        counts = []
        for e in range(8):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
                     for p in ("gate", "up", "down")]
            seen = {importance.tokens.get(n, 0) for n in names}
            assert len(seen) == 1, names  # an expert's matrices see the same tokens
            counts.append(seen.pop())
        assert sum(counts) == 2 * windows  # top-2 routing: every token reaches two experts
        assert sum(c > 0 for c in counts) >= 6, counts  # the rest of the layer is covered
    missing = quantized - collected
    assert all(".mlp.experts." in name for name in missing), missing
    imp = importance.get("model.layers.1.mlp.experts.0.down_proj.weight")
    assert imp is not None and imp.shape == (64,) and (imp > 0).all()


@pytest.mark.parametrize("gguf_type", ["q4_0", "q4_1"])
def test_importance_lowers_the_activation_weighted_error(tiny_demo, importance, tmp_path,
                                                         gguf_type):
    """sum_j imp_j (w_j - q_j)^2 over every matrix (the layer output error on calibration
    data, up to input correlations) drops with the importance matrix."""
    plain = export_gguf(tiny_demo, tmp_path / "p.gguf", gguf_type, show_progress=False)
    weighted = export_gguf(tiny_demo, tmp_path / "w.gguf", gguf_type, importance=importance,
                           show_progress=False)
    assert weighted.imatrix and not plain.imatrix
    assert gguf.GGUFReader(tmp_path / "w.gguf").fields["imatrix.chunk_count"].contents() == 4
    source = CheckpointReader(tiny_demo)
    errors = {}
    for label, path in (("plain", tmp_path / "p.gguf"), ("weighted", tmp_path / "w.gguf")):
        total = 0.0
        for name, t in _tensors(path).items():
            if not name.startswith("blk.0.") or t.tensor_type.name != gguf_type.upper():
                continue
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            role = name.split(".")[2]
            if role.endswith("_exps"):
                proj = role.removeprefix("ffn_").removesuffix("_exps")
                keys = [f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight" for e in range(8)]
            else:
                proj = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                        "attn_output": "o_proj"}[role]
                keys, got = [f"model.layers.0.self_attn.{proj}.weight"], got[None]
            for g, key in zip(got, keys, strict=True):
                imp = importance.get(key)
                if imp is not None:
                    total += float((((g - source.get(key).float().numpy()) ** 2) * imp).sum())
        errors[label] = total
    assert errors["weighted"] < 0.9 * errors["plain"], errors


def _handed_off(source: CheckpointReader, tensor: gguf.ReaderTensor, module: str,
                method: str) -> tuple[int, int]:
    """Checks one handed-off Q4_1 tensor (experts stacked when ``module`` has ``{e}``) against
    the artifact: codes and scales bit for bit, weights within 2^-11 of the fp16-rounded minimum
    and exact where scale*zero is an fp16 number. Returns (exact weights, weights)."""
    got_all = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    got_all = got_all if got_all.ndim == 3 else got_all[None]
    exact = total = 0
    for e, got in enumerate(got_all):
        key = module.format(e=e)
        names = ("qweight", "qzeros", "scales") + (("g_idx",) if method == "gptq" else ())
        t = {n: source.get(f"{key}.{n}") for n in names}
        qw = unpack_gptq(t, 4, 32) if method == "gptq" else unpack_awq(t, 32)
        want = qw.dequantize().numpy()
        offset = (qw.scales * qw.zeros.float()).numpy().repeat(HANDOFF_GROUP, axis=1)
        representable = offset.astype(np.float16).astype(np.float32) == offset
        assert (np.abs(got - want) <= np.abs(offset) * 2.0**-11 + 1e-12).all(), key
        np.testing.assert_array_equal(got[representable], want[representable])
        blocks = tensor.data.reshape(got_all.shape[0], got.shape[0], -1, 20)[e]
        np.testing.assert_array_equal(blocks[..., :2].copy().view(np.float16)[..., 0],
                                      qw.scales.numpy().astype(np.float16))
        exact += int((got == want).sum())
        total += got.size
    return exact, total


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_artifact_hands_its_codes_to_q4_1(packed, tmp_path, method):
    """The Q4_1 blocks carry the artifact's codes and scales bit for bit; the minimum
    -scale*zero is the one value rounded (to fp16), so the weights agree to 2^-11 of it and
    exactly wherever scale*zero is an fp16 number. The 16-bit embeddings (rows of 128, not a
    Q6_K super-block) are Q8_0, as llama.cpp's own Q4_1 writes them."""
    out = tmp_path / f"{method}.gguf"
    result = export_gguf(packed / method, out, "q4_1", show_progress=False)
    assert result.lossless and set(result.types.values()) == {"Q4_1", "Q8_0", "F32"}
    assert result.types["blk.0.ffn_up_exps.weight"] == "Q4_1"
    assert result.types["token_embd.weight"] == "Q8_0"
    source = CheckpointReader(packed / method)
    tensors = _tensors(out)
    exact = total = 0
    for name, module in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj"),
                         ("blk.3.ffn_down_exps.weight", "model.layers.3.mlp.experts.{e}.down_proj")):
        e, t = _handed_off(source, tensors[name], module, method)
        exact, total = exact + e, total + t
    assert exact / total > 0.2
    embeddings = source.get("model.embed_tokens.weight").float().numpy()
    np.testing.assert_array_equal(tensors["token_embd.weight"].data,
                                  quantize(embeddings, QType.Q8_0))


@pytest.mark.slow
def test_handoff_quantizes_embeddings_and_head_as_llama_cpps_q4_1(tiny_tokenizer, tmp_path):
    """Rows of 256, an untied model: a GPTQ g32 artifact's 16-bit output head becomes Q6_K and
    its embeddings the base Q4_1 (the bytes of thresher's quantizers, llama.cpp's types for them
    in its Q4_1), every linear layer stays the artifact's Q4_1 blocks, and the two 16-bit
    matrices shrink to under 45% of F16."""
    from thresher.compress.api import quantize_model

    model = build_random_model("qwen3_moe", hidden_size=256, head_dim=32, num_attention_heads=8,
                               vocab_size=len(tiny_tokenizer))
    save_model(model, tiny_tokenizer, tmp_path / "m")
    quantize_model(tmp_path / "m", QuantizeStage(method="gptq", group_size=32, sym=False), CAL,
                   tmp_path / "gptq", show_progress=False)
    result = export_gguf(tmp_path / "gptq", tmp_path / "q.gguf", "q4_1", show_progress=False)
    assert result.types["token_embd.weight"] == "Q4_1" and result.types["output.weight"] == "Q6_K"
    assert {t for n, t in result.types.items() if n.endswith("weight") and "norm" not in n
            and "gate_inp" not in n and n not in ("token_embd.weight", "output.weight")} == {"Q4_1"}
    source = CheckpointReader(tmp_path / "gptq")
    tensors = _tensors(tmp_path / "q.gguf")
    for name, key, qtype, bound in (("token_embd.weight", "model.embed_tokens.weight", QType.Q4_1,
                                     0.12),
                                    ("output.weight", "lm_head.weight", QType.Q6_K, 0.03)):
        weights = source.get(key).float().numpy()
        np.testing.assert_array_equal(tensors[name].data, quantize(weights, qtype))
        got = gguf.quants.dequantize(tensors[name].data, qtype)
        assert np.linalg.norm(got - weights) < bound * np.linalg.norm(weights)
    _handed_off(source, tensors["blk.1.ffn_gate_exps.weight"],
                "model.layers.1.mlp.experts.{e}.gate_proj", "gptq")
    _handed_off(source, tensors["blk.0.attn_v.weight"], "model.layers.0.self_attn.v_proj", "gptq")
    f16_bytes = 2 * sum(source.get(k).numel() for k in ("model.embed_tokens.weight",
                                                        "lm_head.weight"))
    quantized_bytes = sum(int(tensors[n].n_bytes) for n in ("token_embd.weight", "output.weight"))
    assert quantized_bytes < 0.45 * f16_bytes  # 6.56 and 5 of 16 bits


def test_packed_artifacts_that_cannot_hand_off_are_refused(packed, tiny_demo, tmp_path):
    with pytest.raises(ExportError, match="--type q4_1 only"):
        export_gguf(packed / "gptq", tmp_path / "a.gguf", "q4_k_m")
    with pytest.raises(ExportError, match="codes are already chosen"):
        export_gguf(packed / "gptq", tmp_path / "a.gguf", "q4_1",
                    importance=compute_importance(tiny_demo, CalibrationConfig(samples=1, seq_len=16),
                                                  show_progress=False))
    from thresher.compress.api import quantize_model

    quantize_model(tiny_demo, QuantizeStage(method="rtn", group_size=64), CAL, tmp_path / "g64",
                   show_progress=False)
    with pytest.raises(ExportError, match="groups of 64.*only group size 32"):
        export_gguf(tmp_path / "g64", tmp_path / "a.gguf", "q4_1")
    assert not list(tmp_path.glob("*.gguf"))


def test_recipe_names_the_exporters_types():
    from typing import get_args

    from pydantic import ValidationError

    from thresher.export import GGUF_TYPES
    from thresher.recipe import GGUFTypeName, PublishConfig

    assert set(get_args(GGUFTypeName)) == set(GGUF_TYPES)
    assert PublishConfig(formats=["hf", "gguf"], gguf_types=["q4_k_m"]).gguf_types == ["q4_k_m"]
    with pytest.raises(ValidationError, match="formats must include hf"):
        PublishConfig(formats=["gguf"])
    with pytest.raises(ValidationError, match="gguf_types"):
        PublishConfig(formats=["hf", "gguf"], gguf_types=["q2_k"])


@pytest.mark.slow
def test_publish_hands_off_q4_1_and_requantizes_other_types(packed, tmp_path):
    """A GPTQ-4 g32 variant asked for q4_1 and q4_k_m: q4_1 is its codes as they are, q4_k_m is
    rounded from its dequantized weights (a second rounding, measured and said in the card);
    both files and nothing else land in the variant's .gguf directory."""
    from thresher.export.llama_runtime import LLAMA_CPP_AVAILABLE, LlamaCppModel
    from thresher.flows.stages import publish_gguf
    from thresher.recipe import PerplexityConfig

    artifact, work = packed / "gptq", tmp_path / "work"
    args = (str(artifact), "h1", str(tmp_path / "pub"), "g", ["q4_1", "q4_k_m"], None,
            PerplexityConfig(seq_len=64, max_windows=4), str(work))
    result = publish_gguf.fn(*args, variant_perplexity=100.0)
    dest = tmp_path / "pub" / "g.gguf"
    assert sorted(p.name for p in dest.iterdir()) == ["README.md", "g-q4_1.gguf",
                                                      "g-q4_k_m.gguf", "source.json"]
    assert result["files"] == [str(dest / "g-q4_1.gguf"), str(dest / "g-q4_k_m.gguf")]
    assert list(work.iterdir()) == []  # the dequantized weights were temporary
    m = result["metrics"]
    assert "gguf/q4_1/perplexity" not in m and m["gguf/q4_1/size_bytes"] > 0
    assert m["gguf/q4_k_m/requantized"] == 1.0 and 1 < m["gguf/q4_k_m/perplexity"] < 1e4
    assert len(result["window_nll"]["gguf/q4_k_m"]) == 4
    assert _tensors(dest / "g-q4_1.gguf")["blk.0.ffn_up_exps.weight"].tensor_type == QType.Q4_1
    # q4_k_m's blocks are the variant's own dequantized weights rounded (rows of 128: Q5_0)
    module = "model.layers.0.self_attn.q_proj"
    reader = CheckpointReader(artifact)
    weights = unpack_gptq({n: reader.get(f"{module}.{n}") for n in
                           ("qweight", "qzeros", "scales", "g_idx")}, 4, 32).dequantize()
    out = _tensors(dest / "g-q4_k_m.gguf")["blk.0.attn_q.weight"]
    assert out.tensor_type == QType.Q5_0
    np.testing.assert_array_equal(np.asarray(out.data), quantize(weights.numpy(), QType.Q5_0))
    card = (dest / "README.md").read_text()
    assert "`g-q4_1.gguf` (hand-off)" in card and "`g-q4_k_m.gguf` (requantized)" in card
    assert "second rounding" in card and f"{m['gguf/q4_k_m/perplexity']:.3f}" in card
    before = (dest / "g-q4_k_m.gguf").stat().st_mtime_ns
    assert publish_gguf.fn(*args, variant_perplexity=100.0) == result  # not rebuilt
    assert (dest / "g-q4_k_m.gguf").stat().st_mtime_ns == before
    if LLAMA_CPP_AVAILABLE:
        for path in result["files"]:
            LlamaCppModel(path, n_ctx=64).close()
