"""thresher's NF4 dequantization (``thr_nf4_dequant``): in bf16 the bits of bitsandbytes'
``dequantize_4bit``, in fp32 those of the dequantizing reference, in the AVX-512 build and the
Haswell build's scalar loop; the matmuls that multiply by it through a bounded buffer."""

from __future__ import annotations

import pytest
import torch

from thresher.formats.nf4 import NF4Weight, bitsandbytes_functional
from thresher.serve_kernels.kernels import cpu_blocked, cpu_native, cpu_nf4

pytestmark = pytest.mark.skipif(cpu_native.library() is None,
                                reason="the C kernels do not build here")
requires_kernel = pytest.mark.skipif(not cpu_nf4.cpu_nf4_available(),
                                     reason="bitsandbytes' CPU NF4 kernel needs AVX512-BF16")


@pytest.fixture(scope="module", params=["native", "haswell"])
def lib(request, tmp_path_factory):
    if request.param == "native":
        return cpu_native.library()
    return cpu_native.load(cpu_native.build("haswell", tmp_path_factory.mktemp("nf4")))


def _weight(n: int, k: int, blocksize: int, double_quant: bool) -> NF4Weight:
    """A random [n, k] weight quantized by bitsandbytes (any CPU), double quantization undone."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    packed, state = bitsandbytes_functional().quantize_4bit(
        w, blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4",
        quant_storage=torch.uint8)
    nf4 = NF4Weight.from_quant_state(packed, state)
    return NF4Weight(nf4.packed, nf4.absmax_fp32().float().contiguous(), nf4.quant_map.float(),
                     nf4.shape, blocksize)


def _pack(n: int, k: int, blocksize: int, double_quant: bool) -> cpu_nf4.NF4Pack:
    pack = cpu_nf4.pack_nf4_cpu(_weight(n, k, blocksize, double_quant))
    assert pack is not None
    return pack


LAYOUTS = [(256, 64, True), (256, 64, False), (384, 128, True), (96, 32, False)]


@requires_kernel
@pytest.mark.parametrize(("k", "blocksize", "double_quant"), LAYOUTS)
def test_dequant_is_bitsandbytes_bits(lib, k, blocksize, double_quant):
    pack = _pack(64, k, blocksize, double_quant)
    want = bitsandbytes_functional().dequantize_4bit(pack.published, pack.dense_state)
    assert want.dtype == torch.bfloat16
    got = torch.empty(64, k, dtype=torch.bfloat16)
    rc = lib.thr_nf4_dequant(pack.published.data_ptr(), pack.absmax.data_ptr(),
                             pack.quant_map.data_ptr(), blocksize, 64, k, got.data_ptr(), 1)
    assert rc == 0
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert lib.thr_nf4_dequant(pack.published.data_ptr(), pack.absmax.data_ptr(),
                               pack.quant_map.data_ptr(), 48, 64, k, got.data_ptr(), 1) == -2


@pytest.mark.parametrize(("k", "blocksize", "double_quant"), LAYOUTS)
def test_fp32_dequant_is_the_references_bits(lib, k, blocksize, double_quant):
    w = _weight(64, k, blocksize, double_quant)
    got = torch.empty(64, k)
    rc = lib.thr_nf4_dequant(w.packed.data_ptr(), w.absmax.data_ptr(), w.quant_map.data_ptr(),
                             blocksize, 64, k, got.data_ptr(), 0)
    assert rc == 0
    assert torch.equal(got.view(torch.int32), w.dequantize_fp32().view(torch.int32))


@requires_kernel
def test_rows_slice_and_buffer():
    """``dequantize`` of rows n0:n1 is those rows of the whole, written into a given buffer."""
    pack = _pack(96, 256, 64, True)
    whole = cpu_nf4.dequantize(pack)
    buf = torch.empty(40 * 256, dtype=torch.bfloat16)
    part = cpu_nf4.dequantize(pack, 32, 64, buf)
    assert part.data_ptr() == buf.data_ptr()
    assert torch.equal(part, whole[32:64])


@requires_kernel
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
    monkeypatch.setattr(cpu_blocked._scratch, "buffers", {}, raising=False)
    monkeypatch.setattr(bitsandbytes_functional(), "dequantize_4bit",
                        lambda *a, **kw: pytest.fail("bitsandbytes' dequantization was called"))
    y = cpu_nf4.nf4_cpu_matmul(x, pack)
    assert calls == [(0, 40), (40, 80), (80, 96)]
    assert cpu_blocked._scratch.buffers[torch.bfloat16].numel() == 40 * 256
    assert torch.allclose(y.float(), whole, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fp32_matmul_is_the_reference_in_bounded_slices(rows, monkeypatch):
    """``nf4_fp32_matmul`` (CPUs without bitsandbytes' kernel): the reference's fp32 product,
    through slices of at most ``SCRATCH_WEIGHTS`` in fp32; in the input's dtype."""
    from thresher.serve_kernels.kernels.nf4 import nf4_matmul_ref

    w = _weight(96, 256, 64, True)
    assert cpu_nf4.nf4_fp32_holds(w)
    monkeypatch.setattr(cpu_blocked, "SCRATCH_WEIGHTS", 40 * 256)
    monkeypatch.setattr(cpu_blocked._scratch, "buffers", {}, raising=False)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, rows, 256).to(dtype)
        got, want = cpu_nf4.nf4_fp32_matmul(x, w), nf4_matmul_ref(x, w)
        assert got.shape == (2, rows, 96) and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-6)
    assert cpu_blocked._scratch.buffers[torch.float32].numel() == 40 * 256
    straddling = NF4Weight(w.packed, w.absmax, w.quant_map, (128, 160), 64)
    assert not cpu_nf4.nf4_fp32_holds(straddling)  # blocks of 64 across rows of 160: the reference
