"""The CPU int4 paths (torch's ``_weight_int4pack_mm_for_cpu`` and thresher's ``cpu_q4``) against
the dequantizing references.

The kernel computes in bf16 with bf16 scales and zeros, so it cannot match the fp32 reference
bit for bit: rounding the activations, the scales and the (8 - z) * s zeros to bf16 (8 bits of
mantissa, relative 2**-9 each) and the bf16 output leaves a relative error of a few 1e-3 in the
result's norm (3.3e-3 at most measured over these cases). ``TOL`` allows three times that and
stays far below a 4-bit weight's own quantization error (about 10% of the weight's norm).
cpu_q4 rounds the activations to int8 per block of 32 (a step of max|x| / 127, about 0.5% of a
Gaussian block's norm): 4-6e-3 measured on most cases, up to 1.1e-2 on one output row of
per-channel weights, so its ``TOL_Q4`` is 2.5e-2, still far below the weight's own error
(test_cpu_q4.py checks its arithmetic exactly, against the rounded activations).
"""

from __future__ import annotations

import pytest
import torch

from tests.serve_kernels.kernels.helpers import random_awq, random_gptq, rel_err
from thresher.serve_kernels.kernels import cpu_q4, w4a16
from thresher.serve_kernels.kernels.cpu_int4 import (
    default_kernel,
    int4_matmul,
    pack_awq_int4,
    pack_gptq_int4,
)
from thresher.serve_kernels.kernels.cpu_int8 import Int8Pack, Q8Pack
from thresher.serve_kernels.modeling.linear import AWQLinear, GPTQLinear

K, N = 256, 80  # N a multiple of the kernel's 16 but not of 64
TOL = 1e-2
TOL_Q4 = 2.5e-2
KERNELS = ["torch", pytest.param("q4", marks=pytest.mark.skipif(
    cpu_q4.library() is None, reason="cpu_q4 does not build here (no cc, or no AVX2)"))]


def _cpu(tensors):
    return tuple(t.cpu() for t in tensors)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", KERNELS)
def test_gptq_int4_matches_reference(group_size, act_order, m, dtype, kernel):
    tensors, _ = random_gptq(K, N, group_size, act_order)
    tensors = _cpu(tensors)
    pack = pack_gptq_int4(*tensors, kernel=kernel)
    assert pack is not None and pack.kernel == kernel
    assert (pack.perm is not None) == (act_order and group_size != -1)
    x = torch.randn(m, K).to(dtype)
    out = int4_matmul(x, pack)
    assert out.dtype == dtype and out.shape == (m, N)
    tol = TOL_Q4 if kernel == "q4" else TOL
    assert rel_err(out, w4a16.gptq_matmul_ref(x.float(), *tensors)) < tol


def test_gptq_int4_large_group_repeats_its_scale():
    """Groups of 512 rows are held as kernel groups of 256 sharing one scale: still exact."""
    tensors = _cpu(random_gptq(1024, 32, 512, act_order=False)[0])
    pack = pack_gptq_int4(*tensors, kernel="torch")
    assert pack is not None and pack.group_size == 256
    x = torch.randn(3, 1024)
    assert rel_err(int4_matmul(x, pack), w4a16.gptq_matmul_ref(x, *tensors)) < TOL


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", KERNELS)
def test_awq_int4_matches_reference(group_size, m, dtype, kernel):
    tensors = _cpu(random_awq(K, N, group_size)[0])
    pack = pack_awq_int4(*tensors, group_size, kernel=kernel)
    assert pack.kernel == kernel
    x = torch.randn(m, K).to(dtype)
    out = int4_matmul(x, pack)
    tol = TOL_Q4 if kernel == "q4" else TOL
    assert rel_err(out, w4a16.awq_matmul_ref(x.float(), *tensors, group_size)) < tol


def test_unsupported_layouts_keep_the_reference():
    """N not a multiple of 16, or groups of 16 rows, have no int4pack form; cpu_q4 holds any N
    but not groups of 16 rows either."""
    n72 = _cpu(random_gptq(K, 72, 32, act_order=False)[0])
    assert pack_gptq_int4(*n72, kernel="torch") is None
    g16 = _cpu(random_gptq(K, N, 16, act_order=False)[0])
    assert pack_gptq_int4(*g16, kernel="torch") is None
    assert pack_gptq_int4(*g16, kernel="q4") is None
    if cpu_q4.library() is not None:
        pack = pack_gptq_int4(*n72, kernel="q4")
        x = torch.randn(3, K)
        assert rel_err(int4_matmul(x, pack), w4a16.gptq_matmul_ref(x, *n72)) < TOL_Q4


def test_default_kernel_is_q4_where_it_builds():
    assert default_kernel() == ("q4" if cpu_q4.library() is not None else "torch")


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_linear_fast_path_with_bias_matches_reference(kind, monkeypatch):
    bias = torch.randn(N)
    if kind == "gptq":
        qweight, qzeros, scales, g_idx = _cpu(random_gptq(K, N, 64, act_order=True)[0])
        layer = GPTQLinear(qweight, qzeros, scales, g_idx, 4, 64, bias)
    else:
        layer = AWQLinear(*_cpu(random_awq(K, N, 64)[0]), 64, bias)
    x = torch.randn(2, 5, K, dtype=torch.bfloat16)
    monkeypatch.setenv("THRESHER_KERNELS", "torch")
    reference = layer(x)
    layer.pack_for_cpu()
    assert layer.cpu_pack is not None
    assert torch.equal(layer(x), reference)  # the override still selects the reference
    monkeypatch.delenv("THRESHER_KERNELS")
    fast = layer(x)
    tol = TOL_Q4 if layer.cpu_pack.kernel == "q4" else TOL
    assert fast.shape == reference.shape and rel_err(fast, reference) < tol


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("native", [True, False])
def test_gptq8_fast_paths_match_reference(sym, dtype, native, monkeypatch):
    """8-bit runs thresher's 8-bit kernel, per-channel or grouped, holding its codes in place of
    the packed qweight; without the C kernels per-channel 8-bit runs torch's int8 kernel and
    grouped 8-bit keeps the reference."""
    from thresher.formats.gptq import pack_gptq
    from thresher.formats.quantized import QuantizedWeight

    if native and cpu_q4.library() is None:
        pytest.skip("thresher's C kernels do not build here")
    if not native:
        monkeypatch.setenv("THRESHER_CPU_NATIVE", "off")
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (N, K), generator=gen).to(torch.uint8)
    zeros = torch.full((N, 1), 128) if sym else torch.randint(100, 156, (N, 1), generator=gen)
    scales = (torch.rand(N, 1, generator=gen) * 1e-3 + 1e-4).half().float()
    for group_size, g_idx in ((-1, torch.zeros(K)), (32, torch.arange(K) // 32)):
        groups = int(g_idx.max()) + 1
        qw = QuantizedWeight(codes, scales.repeat(1, groups), zeros.int().repeat(1, groups),
                             g_idx.int(), 8, group_size)
        tensors = pack_gptq(qw)
        layer = GPTQLinear(*tensors.values(), 8, group_size, None)
        layer.pack_for_cpu()
        kind = Q8Pack if native else Int8Pack if group_size == -1 else type(None)
        assert isinstance(layer.cpu_pack, kind)
        assert (layer.qweight is None) == native  # the codes held once
        assert torch.equal(layer.packed()["qweight"], tensors["qweight"])
        x = torch.randn(7, K).to(dtype)
        fast = layer(x)
        monkeypatch.setenv("THRESHER_KERNELS", "torch")
        reference = layer(x)
        monkeypatch.delenv("THRESHER_KERNELS")
        assert fast.dtype == dtype and rel_err(fast, reference) < TOL
