"""GPTQ's rounding into the GGUF block grids on the tiny demo's trained weights and their real
Hessians: the file holds exactly the loop's weights, the block scales are the weighted fit's,
the output error is lower than the fit's own rounding, and llama.cpp runs the file."""

import gguf
import numpy as np
import pytest

from tests.export.conftest import CAL
from thresher.errors import ExportError
from thresher.export import compute_importance, dequantize_gguf, export_gguf
from thresher.export.block_gptq import GPTQ_TYPES, gptq_quantize, output_error
from thresher.export.block_quants import code_range, quantize
from thresher.export.llama_runtime import INSTALL_HINT, LLAMA_CPP_AVAILABLE
from thresher.models.checkpoint import CheckpointReader
from thresher.recipe import PerplexityConfig

QType = gguf.GGMLQuantizationType
KEYS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight"]


@pytest.fixture(scope="module")
def importance(tiny_demo):
    return compute_importance(tiny_demo, CAL, show_progress=False, hessians=True)


def _matrix(tiny_demo, importance, key: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A trained matrix and its Hessian; rows of the tiny demo's 64/128 columns are joined in
    pairs for the 256-wide K-quant super-blocks, each half with its own copy of the Hessian (the
    same output error: a block-diagonal Hessian over the joined row)."""
    weights = CheckpointReader(tiny_demo).get(key).float().numpy()
    hessian = importance.hessian(key)
    while weights.shape[1] < block or weights.shape[1] % block:
        weights = weights.reshape(weights.shape[0] // 2, -1)
        zero = np.zeros_like(hessian)
        hessian = np.block([[hessian, zero], [zero, hessian]])
    return weights, hessian


def test_hessians_are_the_importance_matrix_off_its_diagonal(importance):
    """The collected E[x x^T] has the importance (E[x_j^2]) on its diagonal, per matrix, experts
    included, and is symmetric."""
    assert importance.hessians is not None
    for key in KEYS:
        h = importance.hessian(key)
        np.testing.assert_allclose(np.diag(h), importance.get(key), rtol=1e-5)
        np.testing.assert_allclose(h, h.T, rtol=1e-6, atol=1e-8)
    assert importance.hessian("no.such.weight") is None


@pytest.mark.parametrize("qtype", sorted(GPTQ_TYPES, key=lambda q: q.name))
def test_gptq_blocks_hold_the_loop_weights_with_the_fitted_scales(tiny_demo, importance, qtype):
    """On trained matrices with their real Hessians: the blocks dequantize (the gguf package's
    dequantizer) to exactly the weights the GPTQ loop produced; every byte outside the codes is
    the importance-weighted fit's (its scales and minimums); and the output error
    tr((W - Q) H (W - Q)^T) is well below the fit's own rounding on the same scales."""
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    for key in KEYS:
        weights, hessian = _matrix(tiny_demo, importance, key, block)
        blocks, values = gptq_quantize(weights, qtype, hessian)
        assert blocks.shape == (weights.shape[0], weights.shape[1] // block * type_bytes)
        np.testing.assert_array_equal(gguf.quants.dequantize(blocks, qtype), values)
        fitted = quantize(weights, qtype, np.diag(hessian).copy())
        same = _non_code_bytes(qtype)
        np.testing.assert_array_equal(blocks.reshape(-1, type_bytes)[:, same],
                                      fitted.reshape(-1, type_bytes)[:, same])
        plain = gguf.quants.dequantize(fitted, qtype)
        ours, theirs = output_error(weights, values, hessian), output_error(weights, plain, hessian)
        assert ours < 0.7 * theirs, (key, ours, theirs)
    # the plain fit's scales: the same exactness, those scale bytes
    blocks, values = gptq_quantize(weights, qtype, hessian, scales="plain")
    np.testing.assert_array_equal(gguf.quants.dequantize(blocks, qtype), values)
    np.testing.assert_array_equal(blocks.reshape(-1, type_bytes)[:, same],
                                  quantize(weights, qtype).reshape(-1, type_bytes)[:, same])


def _non_code_bytes(qtype: QType) -> np.ndarray:
    """Mask of a block's bytes that hold no code (found by writing two different code sets)."""
    from thresher.export.block_quants import replace_codes

    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    levels, _ = code_range(qtype)
    blocks = np.zeros((1, type_bytes), dtype=np.uint8)
    low = replace_codes(blocks, qtype, np.zeros((1, block), dtype=np.int32))
    high = replace_codes(blocks, qtype, np.full((1, block), levels - 1, dtype=np.int32))
    return (low == high)[0]


def test_export_refuses_gptq_without_hessians(tiny_demo, tmp_path):
    importance = compute_importance(tiny_demo, CAL, show_progress=False)
    with pytest.raises(ExportError, match="Hessians"):
        export_gguf(tiny_demo, tmp_path / "m.gguf", "q4_0", importance=importance, gptq=True)
    with pytest.raises(ExportError, match="Hessians"):
        export_gguf(tiny_demo, tmp_path / "m.gguf", "q4_0", gptq=True)


def test_export_writes_the_gptq_blocks(tiny_demo, importance, tmp_path):
    """The file's expert and attention tensors are gptq_quantize's blocks of each matrix."""
    out = tmp_path / "m.gguf"
    result = export_gguf(tiny_demo, out, "q4_1", importance=importance, gptq=True,
                         show_progress=False)
    assert result.gptq and result.imatrix
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    reader = CheckpointReader(tiny_demo)
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    expected, _ = gptq_quantize(reader.get(key).float().numpy(), QType.Q4_1, importance.hessian(key))
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_down_exps.weight"].data)[3],
                                  expected)
    key = "model.layers.0.self_attn.o_proj.weight"
    expected, _ = gptq_quantize(reader.get(key).float().numpy(), QType.Q4_1, importance.hessian(key))
    np.testing.assert_array_equal(np.asarray(tensors["blk.0.attn_output.weight"].data), expected)


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_CPP_AVAILABLE, reason=INSTALL_HINT)
@pytest.mark.parametrize("gguf_type", ["q4_0", "q4_k_m"])
def test_llama_cpp_runs_the_gptq_file(tiny_demo, importance, tmp_path, gguf_type):
    """llama.cpp's perplexity of the GPTQ-rounded file equals thresher's evaluation of the file's
    dequantized weights to 0.5%, and its greedy text agrees."""
    from tests.export.test_llama_cpp import EVAL, _compare
    from thresher.data.windows import eval_windows
    from thresher.models.loading import load_tokenizer

    out = tmp_path / "m.gguf"
    export_gguf(tiny_demo, out, gguf_type, importance=importance, gptq=True, show_progress=False)
    same = dequantize_gguf(out, tiny_demo, tmp_path / "same")
    theirs, ours, agree = _compare(out, same, eval_windows(load_tokenizer(tiny_demo), EVAL))
    assert theirs == pytest.approx(ours, rel=0.005)
    assert agree >= 0.9, agree


@pytest.mark.slow
def test_publish_gguf_rounds_by_gptq_and_rebuilds_when_it_changes(tiny_demo, importance,
                                                                   tmp_path):
    """The recipe's ``gguf_gptq`` path: the published file holds the GPTQ blocks of the
    recipe's calibration windows, and turning it off rebuilds the plain-importance file."""
    from thresher.flows.stages import publish_gguf

    def publish(gptq: bool) -> gguf.GGUFReader:
        files = publish_gguf.fn(str(tiny_demo), "h0", str(tmp_path), "v", ["q4_0"], CAL,
                                PerplexityConfig(seq_len=64, max_windows=2),
                                str(tmp_path / "work"), gptq=gptq)["files"]
        assert len(files) == 1
        return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(files[0]).tensors}

    key = "model.layers.0.self_attn.o_proj.weight"
    weights = CheckpointReader(tiny_demo).get(key).float().numpy()
    expected, _ = gptq_quantize(weights, QType.Q4_0, importance.hessian(key))
    np.testing.assert_array_equal(publish(True)["blk.0.attn_output.weight"], expected)
    np.testing.assert_array_equal(publish(False)["blk.0.attn_output.weight"],
                                  quantize(weights, QType.Q4_0, importance.get(key)))


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_CPP_AVAILABLE, reason=INSTALL_HINT)
def test_llama_cpp_runs_the_gptq_k_quants_on_small(small_demo, tmp_path):
    """The small demo's rows of 256 take Q3_K, Q4_K and Q5_K: llama.cpp's perplexity of the GPTQ
    ``q3_k_m`` file equals thresher's evaluation of its dequantized weights to 0.5%."""
    from tests.export.test_llama_cpp import EVAL, _compare
    from thresher.data.windows import eval_windows
    from thresher.models.loading import load_tokenizer

    importance = compute_importance(small_demo, CAL, show_progress=False, hessians=True)
    out = tmp_path / "m.gguf"
    result = export_gguf(small_demo, out, "q3_k_m", importance=importance, gptq=True,
                         show_progress=False)
    assert result.types["blk.0.attn_q.weight"] == "Q3_K"
    assert result.types["blk.0.attn_output.weight"] == "Q5_K"  # llama.cpp's, with 8 experts
    same = dequantize_gguf(out, small_demo, tmp_path / "same")
    theirs, ours, agree = _compare(out, same, eval_windows(load_tokenizer(small_demo), EVAL))
    assert theirs == pytest.approx(ours, rel=0.005)
    assert agree >= 0.9, agree
