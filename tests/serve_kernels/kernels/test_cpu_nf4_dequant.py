"""thresher's NF4 dequantization for prefills (``thr_nf4_dequant``): the bits of bitsandbytes'
``dequantize_4bit`` to bf16, in the AVX-512 build and the Haswell build's scalar loop, and the
matmul that multiplies by it through a bounded buffer."""

from __future__ import annotations

import pytest
import torch

from thresher.formats.nf4 import NF4Weight, bitsandbytes_functional
from thresher.serve_kernels.kernels import cpu_blocked, cpu_native, cpu_nf4

pytestmark = [
    pytest.mark.skipif(cpu_native.library() is None, reason="the C kernels do not build here"),
    pytest.mark.skipif(not cpu_nf4.cpu_nf4_available(),
                       reason="bitsandbytes' CPU NF4 kernel needs AVX512-BF16"),
]


@pytest.fixture(scope="module", params=["native", "haswell"])
def lib(request, tmp_path_factory):
    if request.param == "native":
        return cpu_native.library()
    return cpu_native.load(cpu_native.build("haswell", tmp_path_factory.mktemp("nf4")))


def _pack(n: int, k: int, blocksize: int, double_quant: bool, seed: int = 0) -> cpu_nf4.NF4Pack:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    packed, state = bitsandbytes_functional().quantize_4bit(
        w, blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4",
        quant_storage=torch.uint8)
    pack = cpu_nf4.pack_nf4_cpu(NF4Weight.from_quant_state(packed, state))
    assert pack is not None
    return pack


@pytest.mark.parametrize(("k", "blocksize", "double_quant"),
                         [(256, 64, True), (256, 64, False), (384, 128, True), (96, 32, False)])
def test_dequant_is_bitsandbytes_bits(lib, k, blocksize, double_quant):
    pack = _pack(64, k, blocksize, double_quant)
    want = bitsandbytes_functional().dequantize_4bit(pack.published, pack.dense_state)
    assert want.dtype == torch.bfloat16
    got = torch.empty(64, k, dtype=torch.bfloat16)
    rc = lib.thr_nf4_dequant(pack.published.data_ptr(), pack.absmax.data_ptr(),
                             pack.quant_map.data_ptr(), blocksize, 64, k, got.data_ptr())
    assert rc == 0
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert lib.thr_nf4_dequant(pack.published.data_ptr(), pack.absmax.data_ptr(),
                               pack.quant_map.data_ptr(), 48, 64, k, got.data_ptr()) == -2


def test_rows_slice_and_buffer():
    """``dequantize`` of rows n0:n1 is those rows of the whole, written into a given buffer."""
    pack = _pack(96, 256, 64, True)
    whole = cpu_nf4.dequantize(pack)
    buf = torch.empty(40 * 256, dtype=torch.bfloat16)
    part = cpu_nf4.dequantize(pack, 32, 64, buf)
    assert part.data_ptr() == buf.data_ptr()
    assert torch.equal(part, whole[32:64])


@pytest.mark.skipif(not cpu_blocked.amx_matmul(), reason="torch's bf16 matmul has no AMX tiles here")
def test_prefill_matmul_takes_the_c_pass_in_bounded_slices(monkeypatch):
    """From ``dequantize_rows`` rows on, the product is x @ W.T with W from the C pass, in slices
    through a buffer of at most ``SCRATCH_WEIGHTS``; bitsandbytes' dequantization is not called."""
    pack = _pack(96, 256, 64, True)
    w = bitsandbytes_functional().dequantize_4bit(pack.published, pack.dense_state)
    x = torch.randn(cpu_nf4.dequantize_rows(96 * 256) + 5, 256).bfloat16()
    whole = (x @ w.T).float()
    calls = []
    dequantize = cpu_nf4.dequantize

    def counted(pack, n0, n1, out):
        calls.append((n0, n1))
        return dequantize(pack, n0, n1, out)

    monkeypatch.setattr(cpu_nf4, "dequantize", counted)
    monkeypatch.setattr(cpu_blocked, "SCRATCH_WEIGHTS", 40 * 256)  # slices of 40, 40 and 16 rows
    monkeypatch.setattr(cpu_blocked._scratch, "weight", None, raising=False)
    monkeypatch.setattr(bitsandbytes_functional(), "dequantize_4bit",
                        lambda *a, **kw: pytest.fail("bitsandbytes' dequantization was called"))
    y = cpu_nf4.nf4_cpu_matmul(x, pack)
    assert calls == [(0, 40), (40, 80), (80, 96)]
    assert cpu_blocked._scratch.weight.numel() == 40 * 256
    assert torch.allclose(y.float(), whole, rtol=2 ** -7, atol=1e-3)

