"""RMSNorm, rotary embedding and SiLU-and-multiply: references vs. independent formulas (HF's
Llama code where it exists), Triton kernels vs. references, AOT builds."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from tests.serve_kernels.kernels.helpers import DEVICE, AotSpec, aot_compile_all, rel_err
from thresher.serve_kernels.kernels import activation, cpu_native, norm, rotary

DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)]


def test_rms_norm_ref_matches_llama():
    hf = LlamaRMSNorm(100, eps=1e-6)
    hf.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(7, 100)
    assert torch.allclose(norm.rms_norm_ref(x, hf.weight, 1e-6), hf(x), atol=1e-6)


def test_rms_norm_fused_equals_unfused():
    x, r, w = torch.randn(5, 100).half(), torch.randn(5, 100).half(), torch.rand(100) + 0.5
    out, res = norm.rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(res, (x.float() + r.float()).half())
    assert torch.equal(out, norm.rms_norm_ref(res, w, 1e-6))


def _rms_norm_unfused(x, w, eps):
    """The formula the reference computed op by op before it called torch's fused rms_norm."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("w_shape", [(256,), (6, 256)])  # one weight, or one row per head
@pytest.mark.parametrize("w_fp32", [False, True])
def test_rms_norm_ref_is_bit_equal_to_unfused_formula(dtype, w_shape, w_fp32):
    # greedy parity rests on the fused op rounding exactly like the formula it replaced
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 6, 256, generator=gen) * 3).to(dtype)
    r = torch.randn(9, 6, 256, generator=gen).to(dtype)
    w = (torch.rand(*w_shape, generator=gen) + 0.5).to(torch.float32 if w_fp32 else dtype)
    assert torch.equal(norm.rms_norm_ref(x, w, 1e-6), _rms_norm_unfused(x, w, 1e-6))
    out, res = norm.rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(res, (x.float() + r.float()).to(dtype))
    assert torch.equal(out, _rms_norm_unfused(res, w, 1e-6))


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler here, or no AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_shape", [(256,), (6, 256)])  # one weight, or one row per head
@pytest.mark.parametrize("w_fp32", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_c_matches_ref(dtype, w_shape, w_fp32, fused):
    """cpu_norm.c against the reference: the same arithmetic but for the order of the square sum,
    so bf16 outputs agree to the bit on all but a rare rounding tie (at most one in a thousand,
    one ulp) and fp32 ones to a few ulp; the residual sum is exact."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 6, 256, generator=gen) * 3).to(dtype)
    r = torch.randn(9, 6, 256, generator=gen).to(dtype) if fused else None
    w = (torch.rand(*w_shape, generator=gen) + 0.5).to(torch.float32 if w_fp32 else dtype)
    out, ref = norm.rms_norm_c(x, w, 1e-6, r), norm.rms_norm_ref(x, w, 1e-6, r)
    via = norm.rms_norm(x, w, 1e-6, r)  # the dispatcher takes this path on a CPU
    if fused:
        assert torch.equal(out[1], ref[1])
        out, ref, via = out[0], ref[0], via[0]
    assert torch.equal(via, out)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert (out != ref).float().mean() <= 1e-3
        assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=0)


def test_rms_norm_c_declines_what_it_cannot_hold():
    """fp16, a non-contiguous input or a weight in another 16-bit dtype go to the reference."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler here, or no AVX2 and FMA")
    w = torch.rand(64) + 0.5
    assert norm.rms_norm_c(torch.randn(3, 64).half(), w, 1e-6) is None
    assert norm.rms_norm_c(torch.randn(64, 3).T, w, 1e-6) is None
    assert norm.rms_norm_c(torch.randn(3, 64).bfloat16(), w.half(), 1e-6) is None
    assert norm.rms_norm_c(torch.randn(3, 64), w.bfloat16(), 1e-6) is None


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_triton_matches_ref(dtype, tol, fused):
    x = torch.randn(2, 3, 100, device=DEVICE).to(dtype)  # hidden 100: masked 128-wide block
    w = (torch.rand(100, device=DEVICE) + 0.5).to(dtype)
    r = torch.randn_like(x) if fused else None
    out, ref = norm.rms_norm_triton(x, w, 1e-5, r), norm.rms_norm_ref(x, w, 1e-5, r)
    if fused:
        assert rel_err(out[1], ref[1]) < tol
        out, ref = out[0], ref[0]
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) < tol


def test_rotary_ref_matches_hf_rotate_half():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 48, 2).float() / 48))
    cache = rotary.rotary_cos_sin(inv_freq, 64)
    positions = torch.tensor([0, 5, 63, 17])
    q, k = torch.randn(4, 6, 48), torch.randn(4, 2, 48)
    emb = torch.cat([torch.outer(positions.float(), inv_freq)] * 2, dim=-1)
    # HF layout: [batch, heads, seq, D] with cos/sin [batch, seq, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      emb.cos()[None], emb.sin()[None])
    assert torch.allclose(rotary.apply_rotary_ref(q, positions, cache), hf_q[0].transpose(0, 1),
                          atol=1e-5)
    assert torch.allclose(rotary.apply_rotary_ref(k, positions, cache), hf_k[0].transpose(0, 1),
                          atol=1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rotary_triton_matches_ref(dtype, tol):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 48, 2, device=DEVICE).float() / 48))
    cache = rotary.rotary_cos_sin(inv_freq, 100)
    positions = torch.randint(0, 100, (9,), device=DEVICE)
    q = torch.randn(9, 6, 48, device=DEVICE).to(dtype)  # 6 heads, half-dim 24: both masked
    k = torch.randn(9, 3, 48, device=DEVICE).to(dtype)
    for x in (q, k):
        out = rotary.apply_rotary_triton(x, positions, cache)
        assert out.dtype == dtype and rel_err(out, rotary.apply_rotary_ref(x, positions, cache)) < tol


def test_silu_and_mul_ref_matches_formula():
    x = torch.randn(4, 2 * 50)
    gate, up = x[:, :50], x[:, 50:]
    assert torch.allclose(activation.silu_and_mul_ref(x), gate / (1 + torch.exp(-gate)) * up,
                          atol=1e-6)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_and_mul_triton_matches_ref(dtype, tol):
    x = torch.randn(3, 5, 2 * 1100, device=DEVICE).to(dtype)  # 1100 > BLOCK: two column blocks
    out = activation.silu_and_mul_triton(x)
    assert out.shape == (3, 5, 1100) and out.dtype == dtype
    assert rel_err(out, activation.silu_and_mul_ref(x)) < tol


def test_aot_compiles():
    mod = {m: m.__name__ for m in (norm, rotary, activation)}
    specs = [
        AotSpec(f"{mod[norm]}:_rms_norm_kernel",
                {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
                 "out_ptr": "*bf16", "residual_out_ptr": "*bf16", "eps": "fp32"},
                {"HAS_RESIDUAL": fused, "BLOCK": 4096})
        for fused in (False, True)
    ]
    specs.append(AotSpec(f"{mod[rotary]}:_rotary_kernel",
                         {"x_ptr": "*fp16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
                          "out_ptr": "*fp16"}, {"BLOCK_H": 32, "BLOCK_D": 64}))
    specs.append(AotSpec(f"{mod[activation]}:_silu_and_mul_kernel",
                         {"x_ptr": "*fp16", "out_ptr": "*fp16"}, {"BLOCK": activation.BLOCK}))
    aot_compile_all(specs)
