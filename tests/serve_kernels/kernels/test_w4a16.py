"""W4A16 matmuls: references vs. the dense weight, Triton kernels vs. references, AOT builds."""

from __future__ import annotations

import pytest
import torch

from tests.serve_kernels.kernels.helpers import (
    DEVICE,
    AotSpec,
    aot_compile_all,
    random_awq,
    random_gptq,
    rel_err,
)
from thresher.serve_kernels.kernels import w4a16

K, N = 256, 72  # N is not a multiple of the 64-wide tiles, K not of the split-K stride


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_dequantize_matches_dense(group_size, act_order):
    (qweight, qzeros, scales, g_idx), w = random_gptq(K, N, group_size, act_order)
    assert torch.equal(w4a16.gptq_dequantize(qweight, qzeros, scales, g_idx).cpu(), w)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_awq_dequantize_matches_dense(group_size):
    (qweight, qzeros, scales), w = random_awq(K, N, group_size)
    assert torch.equal(w4a16.awq_dequantize(qweight, qzeros, scales, group_size).cpu(), w)


def test_gptq_symmetric_v1_zero_word():
    """Symmetric v1 checkpoints store 0x77777777: zero 8, so q=8 dequantizes to 0."""
    qweight = torch.full((1, 8), 0x88888888 - 2**32, dtype=torch.int32)
    qzeros = torch.full((1, 1), 0x77777777, dtype=torch.int32)
    w = w4a16.gptq_dequantize(qweight, qzeros, torch.ones(1, 8), torch.zeros(8, dtype=torch.int32))
    assert torch.equal(w, torch.zeros(8, 8))


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("group_size,act_order", [(32, True), (64, False), (128, True), (-1, False)])
def test_gptq_triton_matches_ref(m, group_size, act_order):
    tensors, _ = random_gptq(K, N, group_size, act_order, seed=m)
    x = torch.randn(m, K, dtype=torch.float16, device=DEVICE)
    out = w4a16.gptq_matmul_triton(x, *tensors)
    assert out.dtype == x.dtype and out.shape == (m, N)
    assert rel_err(out, w4a16.gptq_matmul_ref(x, *tensors)) < 1e-2


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_awq_triton_matches_ref(m, group_size):
    tensors, _ = random_awq(K, N, group_size, seed=m)
    x = torch.randn(m, K, dtype=torch.float16, device=DEVICE)
    out = w4a16.awq_matmul_triton(x, *tensors, group_size)
    assert out.dtype == x.dtype and out.shape == (m, N)
    assert rel_err(out, w4a16.awq_matmul_ref(x, *tensors, group_size)) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_other_activation_dtypes(dtype, tol):
    gptq, _ = random_gptq(K, N, 64, True, dtype=dtype)
    awq, _ = random_awq(K, N, 64, dtype=dtype)
    x = torch.randn(2, 5, K, dtype=dtype, device=DEVICE)  # leading dims are flattened
    for cfg in w4a16.CONFIGS.values():
        out = w4a16.gptq_matmul_triton(x, *gptq, config=cfg)
        assert out.shape == (2, 5, N)
        assert rel_err(out, w4a16.gptq_matmul_ref(x, *gptq)) < tol
        assert rel_err(w4a16.awq_matmul_triton(x, *awq, 64, config=cfg),
                       w4a16.awq_matmul_ref(x, *awq, 64)) < tol


def test_dispatch_follows_env(monkeypatch):
    tensors, w = random_gptq(K, N, 64, False)
    x = torch.randn(3, K, device=DEVICE)
    for choice in ("torch", "triton"):
        monkeypatch.setenv("THRESHER_KERNELS", choice)
        assert rel_err(w4a16.gptq_matmul(x, *tensors), x.cpu() @ w) < 1e-5
    monkeypatch.setenv("THRESHER_KERNELS", "cuda")
    with pytest.raises(ValueError, match="THRESHER_KERNELS"):
        w4a16.gptq_matmul(x, *tensors)


def test_aot_compiles():
    specs = []
    for cfg in w4a16.CONFIGS.values():
        types = {"x_ptr": "*fp16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32",
                 "scales_ptr": "*fp16", "g_idx_ptr": "*i32",
                 "out_ptr": "*fp32" if cfg.split_k > 1 else "*fp16"}
        # fp16 operands for both targets; bf16 lowers the same way, so one target suffices
        for dot, archs in (("tl.float16", (80, 90)), ("tl.bfloat16", (90,))):
            consts = {**cfg.constexprs, "DOT_DTYPE": dot, "SPLIT_K": cfg.split_k}
            for kernel in ("_gptq_matmul_kernel", "_awq_matmul_kernel"):
                specs.append(AotSpec(f"{w4a16.__name__}:{kernel}", types, consts,
                                     cfg.num_warps, cfg.num_stages, archs))
    grouped_types = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32",
                     "scales_ptr": "*bf16", "out_ptr": "*fp32"}
    for cfg in w4a16.GROUPED_CONFIGS.values():  # the grouped kernel: GEMV and dot tiles
        for awq in (False, True):
            consts = {**cfg.constexprs, "DOT_DTYPE": "tl.bfloat16", "SPLIT_K": cfg.split_k,
                      "AWQ": awq}
            specs.append(AotSpec(f"{w4a16.__name__}:_grouped_matmul_kernel", grouped_types,
                                 consts, cfg.num_warps, cfg.num_stages, (90,)))
    aot_compile_all(specs)


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_grouped_kernel_matches_ref(m, group_size):
    """Contiguous groups: GPTQ without act-order (what gptq_matmul_triton dispatches with a
    group_size) and AWQ, as a GEMV (m=1) and as dot tiles (decode m=3, prefill m=40)."""
    gptq, _ = random_gptq(K, N, group_size, False, seed=m)
    awq, _ = random_awq(K, N, group_size, seed=m)
    x = torch.randn(m, K, dtype=torch.float16, device=DEVICE)
    assert w4a16.grouped_config(m, K, group_size).block_m == {1: 1, 3: 16, 40: 64}[m]
    out = w4a16.gptq_matmul_triton(x, *gptq, group_size=group_size)
    assert out.dtype == x.dtype and rel_err(out, w4a16.gptq_matmul_ref(x, *gptq)) < 1e-2
    out = w4a16.grouped_matmul_triton(x, *awq, group_size, awq=True)
    assert rel_err(out, w4a16.awq_matmul_ref(x, *awq, group_size)) < 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="the tiles a GPU tunes over; compiled kernels only")
@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("group_size", [32, 128])
def test_grouped_kernel_every_tuned_tile(m, group_size):
    """Every tile the tuner may pick for a shape computes the same product: a GPU picks by
    timing, so a tile that computes wrongly would fail only on the machines where it wins."""
    gptq, _ = random_gptq(K, N, group_size, False, seed=m)
    awq, _ = random_awq(K, N, group_size, seed=m)
    x = torch.randn(m, K, dtype=torch.float16, device=DEVICE)
    want = {False: w4a16.gptq_matmul_ref(x, *gptq), True: w4a16.awq_matmul_ref(x, *awq, group_size)}
    default = w4a16.grouped_config(m, K, group_size)
    wrong = []
    for cfg in w4a16.tile_candidates(default):
        for is_awq, (qweight, qzeros, scales) in ((False, gptq[:3]), (True, awq)):
            out = w4a16.grouped_matmul_triton(x, qweight, qzeros, scales, group_size, is_awq, cfg)
            err = rel_err(out, want[is_awq])
            if not err < 1e-2:
                wrong.append(f"{'awq' if is_awq else 'gptq'} {cfg}: {err:.3f}")
    assert not wrong, "\n".join(wrong)


def test_prefill_and_decode_share_the_grouped_kernel(monkeypatch):
    """Contiguous groups run the grouped kernel at every batch size, so prefill and decode
    multiply the same exact codes and scale in fp32 (the general kernel would round each
    dequantized weight to the 16-bit dot type first)."""
    launched = []
    launch = w4a16._launch
    monkeypatch.setattr(w4a16, "_launch", lambda kernel, *a, **kw: (
        launched.append(kernel.fn.__name__), launch(kernel, *a, **kw))[1])
    gptq, _ = random_gptq(K, N, 32, False)
    for m in (1, 3, 40):
        w4a16.gptq_matmul_triton(torch.randn(m, K, device=DEVICE), *gptq, group_size=32)
    w4a16.gptq_matmul_triton(torch.randn(40, K, device=DEVICE), *gptq)  # act-order: general
    assert launched == ["_grouped_matmul_kernel"] * 3 + ["_gptq_matmul_kernel"]


def test_grouped_config_limits():
    assert w4a16.grouped_config(17, 4096, 128).block_m == 64  # prefill-sized tiles
    assert w4a16.grouped_config(1, 4096, 48).block_k == 16
    assert w4a16.grouped_config(1, 4096, 40) is None  # no tile of 16..128 divides the group
    with pytest.raises(ValueError, match="group_size=40"):
        w4a16.grouped_matmul_triton(torch.zeros(1, 80), torch.zeros(10, 8, dtype=torch.int32),
                                    torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 8), 40,
                                    awq=False)
