"""thresher's ggml block quantizers on the trained tiny demo model's expert weights, read back
through the gguf package's dequantizer (the layout llama.cpp reads)."""

import gguf
import numpy as np
import pytest

from thresher.export.block_quants import quantize
from thresher.models.checkpoint import CheckpointReader

QType = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def weights(tiny_demo) -> np.ndarray:
    """Every up-projection of every expert, as rows of 256 (one K-quant super-block)."""
    reader = CheckpointReader(tiny_demo)
    return np.concatenate([
        reader.get(f"model.layers.{i}.mlp.experts.{e}.up_proj.weight").float().numpy()
        .reshape(-1, 256) for i in range(4) for e in range(8)])


@pytest.fixture(scope="module")
def importance() -> np.ndarray:
    """A heavy-tailed importance per column, like real activations' mean squares."""
    return np.random.default_rng(0).gamma(0.5, size=256).astype(np.float32)


def _mse(weights, qtype, importance=None, weighting=None) -> float:
    blocks = quantize(weights, qtype, importance)
    err = (gguf.quants.dequantize(blocks, qtype) - weights) ** 2
    return float((err if weighting is None else err * weighting).mean())


def test_k_quants_have_ggml_sizes_and_beat_plain_rounding(weights):
    assert quantize(weights, QType.Q4_K).shape == (weights.shape[0], 144)
    assert quantize(weights, QType.Q6_K).shape == (weights.shape[0], 210)
    assert quantize(weights, QType.Q3_K).shape == (weights.shape[0], 110)
    q4_1 = _mse(weights, QType.Q4_1)  # gguf's min/max rounding at 5 bits per weight
    q4_k = _mse(weights, QType.Q4_K)  # 4.5 bits per weight
    q3_k = _mse(weights, QType.Q3_K)  # 3.44 bits per weight
    q6_k = _mse(weights, QType.Q6_K)
    q8_0 = _mse(weights, QType.Q8_0)
    assert q4_k < 0.9 * q4_1
    assert 2 * q4_k < q3_k < 8 * q4_k  # one bit fewer: about 4x the squared error
    assert q8_0 < q6_k < 0.1 * q4_k


def test_weights_on_the_grid_quantize_to_the_same_bytes(weights):
    """Dequantize, quantize again: Q4_K gives back the bytes, so the scales, minimums and codes
    sit where ggml's block struct has them. The scale search may land on another encoding of the
    same grid where two candidates tie to float rounding (measured: 1 super-block of 1,024 on an
    AVX-512 CPU, none on others), so a few super-blocks may differ, by far less than the rounding."""
    blocks = quantize(weights, QType.Q4_K)
    grid = gguf.quants.dequantize(blocks, QType.Q4_K)
    again = quantize(grid, QType.Q4_K)
    same = (again == blocks).all(1)
    assert same.mean() > 0.995
    moved = ((gguf.quants.dequantize(again, QType.Q4_K) - grid) ** 2)[~same].sum()
    assert moved <= 0.01 * ((grid - weights) ** 2)[~same].sum()
    q6 = gguf.quants.dequantize(quantize(weights, QType.Q6_K), QType.Q6_K)
    assert (gguf.quants.dequantize(quantize(q6, QType.Q6_K), QType.Q6_K) == q6).mean() > 0.999


@pytest.mark.parametrize("qtype", [QType.Q3_K, QType.Q4_K, QType.Q6_K, QType.Q4_0, QType.Q4_1,
                                   QType.Q5_0])
def test_importance_lowers_the_weighted_error(weights, importance, qtype):
    plain = _mse(weights, qtype, None, importance)
    weighted = _mse(weights, qtype, importance, importance)
    assert weighted < 0.85 * plain, (plain, weighted)


def test_uniform_importance_keeps_the_error_of_the_plain_search(weights):
    ones = np.ones(256, dtype=np.float32)
    for qtype in (QType.Q4_0, QType.Q4_1):
        assert _mse(weights, qtype, ones) < 1.02 * _mse(weights, qtype)


def test_zero_and_constant_rows(importance):
    rows = np.zeros((3, 256), dtype=np.float32)
    rows[1] = 0.5
    rows[2, ::2] = -1.0
    for qtype in (QType.Q3_K, QType.Q4_K, QType.Q6_K, QType.Q4_0, QType.Q4_1, QType.Q5_0):
        for imp in (None, importance):
            got = gguf.quants.dequantize(quantize(rows, qtype, imp), qtype)
            np.testing.assert_allclose(got, rows, atol=1e-3, err_msg=f"{qtype.name} {imp is None}")


def test_refuses_misshapen_input(weights):
    with pytest.raises(ValueError, match="rows of 128 values.*Q4_K block"):
        quantize(weights.reshape(-1, 128), QType.Q4_K)
    with pytest.raises(ValueError, match="importance has shape"):
        quantize(weights, QType.Q4_K, np.ones(128, dtype=np.float32))
    with pytest.raises(ValueError, match="Q8_0 has no importance-weighted quantizer"):
        quantize(weights, QType.Q8_0, np.ones(256, dtype=np.float32))
