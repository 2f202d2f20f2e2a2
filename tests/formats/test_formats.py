"""Checkpoint layouts: exact round trips, an independent GPTQ unpacker, AutoAWQ's packer as oracle."""

import math

import pytest
import torch

from thresher.compress.gptq import GPTQ
from thresher.compress.nf4 import nf4_quantize
from thresher.compress.rtn import rtn_quantize
from thresher.formats import bits as bits_mod
from thresher.formats.awq import pack_awq, unpack_awq
from thresher.formats.gptq import pack_gptq, unpack_gptq
from thresher.formats.nf4 import STATE_KEY, pack_nf4, unpack_nf4
from thresher.formats.quantized import QuantizedWeight
from thresher.quant.grid import GridSpec


def random_quantized(n: int, k: int, bits: int, group_size: int, shuffle_groups: bool = False,
                     seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    maxq = 2**bits - 1
    groups = k // group_size
    g_idx = torch.arange(k) // group_size
    if shuffle_groups:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantizedWeight(
        codes=torch.randint(0, maxq + 1, (n, k), generator=gen).to(torch.uint8),
        scales=torch.rand(n, groups, generator=gen).add(0.01).half().float(),
        zeros=torch.randint(1, maxq + 1, (n, groups), generator=gen).to(torch.int32),
        g_idx=g_idx.to(torch.int32), bits=bits, group_size=group_size,
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_gptq_pack_unpack_is_exact(bits, shuffle):
    qw = random_quantized(64, 128, bits, 32, shuffle_groups=shuffle, seed=bits)
    tensors = pack_gptq(qw)
    assert tensors["qweight"].shape == (128 * bits // 32, 64)
    assert tensors["qzeros"].shape == (4, 64 * bits // 32)
    assert tensors["scales"].shape == (4, 64) and tensors["scales"].dtype == torch.float16
    assert tensors["qweight"].dtype == tensors["qzeros"].dtype == tensors["g_idx"].dtype == torch.int32
    back = unpack_gptq(tensors, bits, 32)
    assert torch.equal(back.codes, qw.codes)
    assert torch.equal(back.zeros, qw.zeros)
    assert torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.dequantize(), qw.dequantize())


def independent_gptq_dequant(t: dict, bits: int) -> torch.Tensor:
    """formats.md, read literally: one bit stream per output column along K, qzeros along N
    holding zero - 1; W^T[k, n] = scales[g_idx[k], n] * (q[k, n] - (qzeros[g_idx[k], n] + 1))."""
    qweight = t["qweight"].tolist()
    qzeros = t["qzeros"].tolist()
    scales, g_idx = t["scales"].float(), t["g_idx"].tolist()
    k, n = len(g_idx), len(qweight[0])
    mask = (1 << bits) - 1

    def field(words: list[int], index: int) -> int:
        stream = 0
        for i, word in enumerate(words):
            stream |= (word & 0xFFFFFFFF) << (32 * i)
        return (stream >> (index * bits)) & mask

    columns = [[row[c] for row in qweight] for c in range(n)]
    w = torch.zeros(n, k)
    for c in range(n):
        for r in range(k):
            g = g_idx[r]
            q = field(columns[c], r)
            z = field(qzeros[g], c) + 1
            w[c, r] = scales[g, c] * (q - z)
    return w


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_layout_matches_an_independent_unpacker_with_act_order(bits):
    torch.manual_seed(0)
    x = torch.randn(512, 64) * torch.linspace(0.1, 3, 64)  # distinct diag(H): a real permutation
    w = torch.randn(32, 64)
    gptq = GPTQ(64, "test")
    gptq.add_batch(x)
    qw, _ = gptq.quantize(w, GridSpec(bits, sym=True, min_zero=1), group_size=32, act_order=True,
                          static_groups=False)
    assert not torch.equal(qw.g_idx, qw.g_idx.sort().values), "act-order g_idx is permuted"
    tensors = pack_gptq(qw)
    torch.testing.assert_close(independent_gptq_dequant(tensors, bits), qw.dequantize(),
                               rtol=0, atol=0)


def test_gptq_symmetric_4bit_zeros_are_0x77777777():
    qw = rtn_quantize(torch.randn(16, 64), GridSpec(4, sym=True, min_zero=1), 32)
    words = pack_gptq(qw)["qzeros"]
    assert (words == 0x77777777).all()


def test_awq_pack_unpack_is_exact():
    qw = random_quantized(64, 256, 4, 128)
    tensors = pack_awq(qw)
    assert tensors["qweight"].shape == (256, 8) and tensors["qzeros"].shape == (2, 8)
    back = unpack_awq(tensors, 128)
    assert torch.equal(back.codes, qw.codes) and torch.equal(back.zeros, qw.zeros)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_awq_packing_is_bit_identical_to_autoawq():
    from awq.modules.linear.gemm import WQLinear_GEMM

    torch.manual_seed(0)
    qw = rtn_quantize(torch.randn(64, 256), GridSpec(4, sym=False), 128)
    linear = torch.nn.Linear(256, 64, bias=False)
    linear.weight.data = qw.dequantize()
    oracle = WQLinear_GEMM.from_linear(linear, 4, 128, scales=qw.scales.T.contiguous(),
                                       zeros=qw.zeros.T.contiguous().float())
    ours = pack_awq(qw)
    assert torch.equal(ours["qweight"], oracle.qweight)
    assert torch.equal(ours["qzeros"], oracle.qzeros)
    assert torch.equal(ours["scales"], oracle.scales)


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_serialization_round_trips_through_bitsandbytes(double_quant):
    w = torch.randn(64, 128)
    q = nf4_quantize(w, double_quant, torch.float32)
    tensors = pack_nf4(q)
    expected = {"weight", "weight.absmax", "weight.quant_map", STATE_KEY}
    if double_quant:
        expected |= {"weight.nested_absmax", "weight.nested_quant_map"}
    assert set(tensors) == expected
    assert tensors["weight"].dtype == torch.uint8 and tensors["weight"].numel() == 64 * 128 // 2
    back = unpack_nf4(tensors)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert back.state.blocksize == 64 and back.state.quant_type == "nf4"
    assert (q.dequantize() - w).abs().mean() < 0.1


def _stream_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The definition: column c's codes, row r at bits [r*bits, (r+1)*bits) of one bit stream,
    cut into 32-bit words (as int32)."""
    rows, cols = codes.shape
    out = torch.zeros(rows * bits // 32, cols, dtype=torch.int64)
    for c in range(cols):
        stream = sum(int(codes[r, c]) << (r * bits) for r in range(rows))
        for w in range(out.shape[0]):
            out[w, c] = (stream >> (32 * w)) & 0xFFFFFFFF
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_matches_the_bit_stream_whatever_the_input_layout(bits, words, monkeypatch):
    """The byte path (2, 4, 8 bits on a little-endian machine) and the word path (3 bits, and
    every width where bytes are not words) against the layout's definition, from uint8, int32
    and int64 codes, contiguous or a transposed view (GPTQ packs codes.T)."""
    if words:
        monkeypatch.setattr(bits_mod, "_bytes_pack", lambda bits: False)
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (64, 24), generator=g, dtype=torch.int32)
    want = _stream_words(codes, bits)
    for given in (codes, codes.to(torch.uint8), codes.to(torch.int64),
                  codes.T.contiguous().T, codes.to(torch.uint8).T.contiguous().T):
        got = bits_mod.pack_along_rows(given, bits)
        assert got.dtype == torch.int32 and got.is_contiguous()
        assert torch.equal(got, want)
    assert torch.equal(bits_mod.unpack_along_rows(want, bits, 64), codes)
    assert torch.equal(bits_mod.pack_along_cols(codes.T, bits), want.T)
    assert torch.equal(bits_mod.unpack_along_cols(want.T.contiguous(), bits, 64), codes.T)
    rows = 32 // math.gcd(bits, 32)  # one row of words at 2, 4, 8 bits (as a checkpoint
    few = codes[:rows]  # holds it): its transpose counts as contiguous whatever its last stride
    words = torch.tensor(bits_mod.pack_along_rows(few, bits).tolist(), dtype=torch.int32)
    assert torch.equal(bits_mod.unpack_along_rows(words, bits, rows), few)


def test_awq_interleaving_puts_column_order_i_in_nibble_i():
    """AWQ's word c of a row holds column 8c + AWQ_ORDER[i] in nibble i."""
    from thresher.formats.awq import AWQ_ORDER, _pack_interleaved, _unpack_interleaved

    codes = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(0),
                          dtype=torch.uint8)
    words = _pack_interleaved(codes)
    for r in range(3):
        for c in range(2):
            word = int(words[r, c]) & 0xFFFFFFFF
            for i, col in enumerate(AWQ_ORDER):
                assert (word >> (4 * i)) & 0xF == codes[r, 8 * c + col]
    assert torch.equal(_unpack_interleaved(words), codes.to(torch.int32))
