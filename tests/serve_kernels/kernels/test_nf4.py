"""NF4: the reference against bitsandbytes' own dequantization, the kernel against the reference.

The kernel tests build NF4 weights from random codes, so they run where bitsandbytes is not
installed (the GPU machine's image has none); only the tests against bitsandbytes need it.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.serve_kernels.kernels.helpers import (
    DEVICE,
    AotSpec,
    aot_compile_all,
    record_launches,
    rel_err,
)
from thresher.quant.nf4 import NF4_CODES
from thresher.serve_kernels.kernels import nf4
from thresher.serve_kernels.kernels.backend import TileConfig

N, K = 72, 101  # odd K: bytes and 64-element blocks straddle rows, N*K not a multiple of 64


@pytest.fixture
def bnbf():
    """``bitsandbytes.functional``; the test is skipped where bitsandbytes is not installed."""
    return pytest.importorskip("bitsandbytes.functional")


def quantized(bnbf, n: int, k: int, double_quant: bool, dtype=torch.float32, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                       compress_statistics=double_quant)
    return nf4.NF4Weight.from_quant_state(packed, state), (packed, state)


def random_nf4(n: int, k: int, double_quant: bool, dtype=torch.float32, seed=0) -> nf4.NF4Weight:
    """An NF4 weight of random codes and scales in bitsandbytes' layout (blocks of 64 elements;
    with double quantization, uint8 absmax codes scaled per 256 blocks)."""
    gen = torch.Generator().manual_seed(seed)
    numel = n * k
    blocks = math.ceil(numel / 64)
    packed = torch.randint(0, 256, (math.ceil(numel / 2), 1), generator=gen, dtype=torch.uint8)
    quant_map = torch.tensor(NF4_CODES, dtype=torch.float32)
    if not double_quant:
        absmax = torch.rand(blocks, generator=gen) * 2 + 0.5
        return nf4.NF4Weight(packed, absmax, quant_map, (n, k), dtype=dtype)
    nested = dict(nested_absmax=torch.rand(math.ceil(blocks / 256), generator=gen) + 0.5,
                  nested_quant_map=torch.linspace(-1, 1, 256), nested_offset=1.5)
    absmax = torch.randint(0, 256, (blocks,), generator=gen, dtype=torch.uint8)
    return nf4.NF4Weight(packed, absmax, quant_map, (n, k), dtype=dtype, **nested)


def on_device(weight: nf4.NF4Weight) -> nf4.NF4Weight:
    """``weight`` with its tensors on the kernels' device (CUDA where there is one)."""
    return nf4.NF4Weight(**{f: getattr(weight, f).to(DEVICE) if torch.is_tensor(getattr(weight, f))
                            else getattr(weight, f) for f in weight.__dataclass_fields__})


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(72, 100), (33, 66)])
def test_dequantize_matches_bitsandbytes(bnbf, double_quant, shape):
    # even K: for odd K bitsandbytes' CPU backend falls back to a torch.compile'd path (slow)
    weight, (packed, state) = quantized(bnbf, *shape, double_quant)
    assert (weight.nested_absmax is not None) == double_quant
    expected = bnbf.dequantize_4bit(packed, state).float()
    assert torch.allclose(nf4.nf4_dequantize(weight), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("double_quant", [False, True])
def test_triton_matches_ref(m, double_quant):
    weight = on_device(random_nf4(N, K, double_quant, dtype=torch.float16, seed=m))
    x = torch.randn(m, K, dtype=torch.float16, device=DEVICE)
    out = nf4.nf4_matmul_triton(x, weight)
    assert out.shape == (m, N) and out.dtype == x.dtype
    assert rel_err(out, nf4.nf4_matmul_ref(x, weight)) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_other_dtypes_and_configs(dtype, tol):
    weight = on_device(random_nf4(N, K, True))
    x = torch.randn(5, K, dtype=dtype, device=DEVICE)
    for cfg in nf4.CONFIGS.values():
        assert rel_err(nf4.nf4_matmul_triton(x, weight, cfg), nf4.nf4_matmul_ref(x, weight)) < tol


@pytest.mark.parametrize("block_k", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 5])
def test_rows_of_whole_blocks_compute_the_flat_indexing(block_k, m, monkeypatch):
    """K a multiple of 64: each row holds whole blocks, so the kernel indexes by row and column
    (one absmax per column where the K tile lies in one block) and computes bit for bit what the
    flattened indexing computes, which the reference checks."""
    k = 192
    weight = on_device(random_nf4(N, k, True, dtype=torch.float16, seed=m))
    x = torch.randn(m, k, dtype=torch.float16, device=DEVICE)
    cfg = TileConfig(block_m=16, block_n=32, block_k=block_k, split_k=1, num_warps=4,
                     num_stages=2)
    launches = record_launches(monkeypatch, nf4, "ROW_BLOCKS")
    rows, flat = (nf4.nf4_matmul_triton(x, weight, cfg, row_blocks=r) for r in (True, False))
    assert torch.equal(rows, flat) and launches == [True, False]
    assert rel_err(rows, nf4.nf4_matmul_ref(x, weight)) < 1e-2


def test_dispatch_torch_on_cpu(bnbf, monkeypatch):
    monkeypatch.delenv("THRESHER_KERNELS", raising=False)
    weight, (packed, state) = quantized(bnbf, N, 100, False)
    x = torch.randn(2, 100)
    expected = x @ bnbf.dequantize_4bit(packed, state).float().T
    assert rel_err(nf4.nf4_matmul(x, weight), expected) < 1e-6


def test_aot_compiles():
    specs = []
    for cfg in nf4.CONFIGS.values():
        types = {"x_ptr": "*fp16", "packed_ptr": "*u8", "absmax_ptr": "*fp32",
                 "quant_map_ptr": "*fp32", "out_ptr": "*fp32" if cfg.split_k > 1 else "*fp16"}
        for row_blocks in (False, True):
            consts = {**cfg.constexprs, "DOT_DTYPE": "tl.float16", "SPLIT_K": cfg.split_k,
                      "BLOCKSIZE": 64, "ROW_BLOCKS": row_blocks}
            specs.append(AotSpec(f"{nf4.__name__}:_nf4_matmul_kernel", types, consts,
                                 cfg.num_warps, cfg.num_stages))
    aot_compile_all(specs)
