"""Fused MoE: alignment invariants, the reference against a per-token dense computation, the
Triton path against the reference for dense, GPTQ, AWQ and NF4 experts, AOT builds."""

from __future__ import annotations

import pytest
import torch

from tests.serve_kernels.kernels.helpers import (
    DEVICE,
    AotSpec,
    aot_compile_all,
    random_awq,
    random_gptq,
    record_launches,
    rel_err,
)
from thresher.formats.nf4 import NF4Weight
from thresher.quant.nf4 import NF4_CODES
from thresher.serve_kernels.kernels import moe

E, H, INTER, TOP_K = 4, 96, 48, 2  # 96 and 2*48 are not multiples of the 64-wide tiles


def stacked(fmt: str, k: int, n: int, dtype=torch.float16) -> moe.ExpertWeights:
    """Random weights of E experts for a [K -> N] projection in ``fmt``."""
    if fmt == "dense":
        return moe.ExpertWeights("dense", (torch.randn(E, n, k, device=DEVICE) / k**0.5).to(dtype))
    if fmt == "gptq":
        sets = [random_gptq(k, n, 32, act_order=True, dtype=dtype, seed=e)[0] for e in range(E)]
        q, z, s, g = (torch.stack(t) for t in zip(*sets, strict=True))
        return moe.ExpertWeights("gptq", q, scales=s, qzeros=z, g_idx=g)
    sets = [random_awq(k, n, 16, dtype=dtype, seed=e)[0] for e in range(E)]
    q, z, s = (torch.stack(t) for t in zip(*sets, strict=True))
    return moe.ExpertWeights("awq", q, scales=s, qzeros=z, group_size=16)


def routing(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def test_moe_align_groups_every_pair_once():
    _, ids = routing(11)
    sorted_ids, expert_ids = moe.moe_align(ids, E, 4)
    assert sorted_ids.numel() == 4 * expert_ids.numel()
    real = sorted_ids[sorted_ids < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))
    block_expert = expert_ids.repeat_interleave(4)
    is_real = sorted_ids < ids.numel()
    assert torch.equal(ids.flatten()[sorted_ids[is_real].long()], block_expert[is_real])


def test_moe_align_sizes_come_from_the_shape_alone():
    """Worst-case buffers (no device read): the same sizes whatever the routing; blocks past the
    last run carry expert -1 and only padding."""
    skewed = torch.zeros(11, TOP_K, dtype=torch.long, device=DEVICE)  # every pair to expert 0
    skewed[:, 1] = 1
    _, spread = routing(11)
    sizes = set()
    for ids in (skewed, spread):
        sorted_ids, expert_ids = moe.moe_align(ids, E, 4)
        sizes.add((sorted_ids.numel(), expert_ids.numel()))
        unused = expert_ids.repeat_interleave(4) < 0
        assert bool((sorted_ids[unused] == ids.numel()).all())
    assert sizes == {(4 * 9, 9)}  # 22 pairs + 4 experts x 3 padding rows, in blocks of 4
    assert (moe.moe_align(skewed, E, 4)[1] < 0).sum() == 3  # 2 runs of 3 blocks used of 9


def test_triton_with_one_expert_taking_every_token():
    w1, w2 = stacked("dense", H, 2 * INTER), stacked("dense", INTER, H)
    x = torch.randn(7, H, device=DEVICE).half()
    ids = torch.full((7, TOP_K), 3, dtype=torch.long, device=DEVICE)
    ids[:, 1] = 0
    weights = torch.full((7, TOP_K), 0.5, device=DEVICE)
    out = moe.fused_moe_triton(x, w1, w2, weights, ids)
    assert rel_err(out, moe.fused_moe_ref(x, w1, w2, weights, ids)) < 1e-2


@pytest.mark.parametrize("fmt", ["dense", "gptq", "awq"])
def test_ref_matches_per_token_dense(fmt):
    w1, w2 = stacked(fmt, H, 2 * INTER), stacked(fmt, INTER, H)
    x = torch.randn(5, H, device=DEVICE)
    weights, ids = routing(5)
    d1, d2 = w1.dequantize(), w2.dequantize()
    expected = torch.zeros(5, H)
    for t in range(5):
        for j in range(TOP_K):
            e = ids[t, j]
            h = d1[e] @ x[t]
            expected[t] += weights[t, j].cpu() * (d2[e] @ (torch.nn.functional.silu(h[:INTER])
                                                         * h[INTER:])).cpu()
    assert rel_err(moe.fused_moe_ref(x, w1, w2, weights, ids), expected) < 1e-5


def test_dequantized_layouts_agree_with_dense_weight():
    """GPTQ/AWQ ExpertWeights.dequantize gives [E, N, K] like the dense layout."""
    (q, z, s, g), w = random_gptq(H, 2 * INTER, 32, act_order=True)
    ew = moe.ExpertWeights("gptq", q[None], scales=s[None], qzeros=z[None], g_idx=g[None])
    assert ew.out_in == (2 * INTER, H)
    assert torch.equal(ew.dequantize()[0].cpu(), w.T)
    (q, z, s), w = random_awq(H, 2 * INTER, 16)
    ew = moe.ExpertWeights("awq", q[None], scales=s[None], qzeros=z[None], group_size=16)
    assert ew.out_in == (2 * INTER, H)
    assert torch.equal(ew.dequantize()[0].cpu(), w.T)


@pytest.mark.parametrize("fmt", ["dense", "gptq", "awq"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_triton_matches_ref(fmt, tokens):
    w1, w2 = stacked(fmt, H, 2 * INTER), stacked(fmt, INTER, H)
    x = torch.randn(tokens, H, device=DEVICE).half()
    weights, ids = routing(tokens, seed=tokens)
    out = moe.fused_moe_triton(x, w1, w2, weights, ids)
    assert out.shape == (tokens, H) and out.dtype == x.dtype
    assert rel_err(out, moe.fused_moe_ref(x, w1, w2, weights, ids)) < 1e-2


def contiguous(fmt: str, k: int, n: int, group: int) -> moe.ExpertWeights:
    """Random experts in contiguous groups (GPTQ without act-order, AWQ)."""
    if fmt == "gptq":
        sets = [random_gptq(k, n, group, act_order=False, seed=e)[0] for e in range(E)]
        q, z, s, g = (torch.stack(t) for t in zip(*sets, strict=True))
        return moe.ExpertWeights("gptq", q, scales=s, qzeros=z, g_idx=g, contiguous_group=group)
    sets = [random_awq(k, n, group, seed=e)[0] for e in range(E)]
    q, z, s = (torch.stack(t) for t in zip(*sets, strict=True))
    return moe.ExpertWeights("awq", q, scales=s, qzeros=z, group_size=group)


@pytest.mark.parametrize("fmt,group", [("gptq", 64), ("gptq", -1), ("awq", 64)])
@pytest.mark.parametrize("tokens", [1, 40])
def test_row_groups_compute_the_gathered_tiles(fmt, group, tokens, monkeypatch):
    """Contiguous groups that each K tile lies in: the kernel loads one row of zeros and scales
    per tile (and a GPTQ word once), and computes bit for bit what the per-weight gather does."""
    launches = record_launches(monkeypatch, moe, "ROW_GROUPS")
    h, inter = 128, 64  # two groups of 64 in gate_up's K, one in down's
    w1, w2 = contiguous(fmt, h, 2 * inter, group), contiguous(fmt, inter, h, group)
    x = torch.randn(tokens, h, device=DEVICE).half()
    weights, ids = routing(tokens, seed=tokens)
    cfg = moe.DECODE if tokens * TOP_K <= 64 else moe.PREFILL
    assert w1.row_group(cfg.block_k) and w2.row_group(cfg.block_k)
    sorted_ids, expert_ids = moe.moe_align(ids, E, cfg.block_m)
    for w, a, per_row in ((w1, x, TOP_K), (w2, torch.randn(tokens * TOP_K, inter, device=DEVICE)
                                           .half(), 1)):
        rows, gathered = (moe.moe_matmul_triton(a, w, sorted_ids, expert_ids, tokens * TOP_K,
                                                per_row, None, cfg, row_groups=r, tune=False)
                          for r in (True, False))
        assert torch.equal(rows, gathered)
    assert launches == [True, False, True, False]
    out = moe.fused_moe_triton(x, w1, w2, weights, ids)
    assert rel_err(out, moe.fused_moe_ref(x, w1, w2, weights, ids)) < 1e-2


def test_row_groups_need_contiguous_groups_the_tile_divides():
    (q, z, s, g), _ = random_gptq(128, 64, 32, act_order=True)
    gathered = moe.ExpertWeights("gptq", q[None], scales=s[None], qzeros=z[None], g_idx=g[None])
    assert gathered.row_group(64) is None  # act-order: no contiguous group known
    assert contiguous("gptq", 128, 64, 32).row_group(64) is None  # tiles span two groups
    assert contiguous("gptq", 128, 64, 32).row_group(32) == 32
    assert contiguous("awq", 128, 64, -1).row_group(64) == 128


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_other_dtypes_and_configs(dtype, tol):
    w1, w2 = stacked("dense", H, 2 * INTER, dtype), stacked("gptq", INTER, H, dtype)
    x = torch.randn(6, H, device=DEVICE).to(dtype)
    weights, ids = routing(6)
    ref = moe.fused_moe_ref(x, w1, w2, weights, ids)
    for cfg in moe.CONFIGS.values():
        assert rel_err(moe.fused_moe_triton(x, w1, w2, weights, ids, cfg), ref) < tol


def test_aot_compiles():
    specs = []
    for cfg in moe.CONFIGS.values():
        for fmt, code in moe.FORMATS.items():
            b = {"dense": "*fp16", "nf4": "*u8"}.get(fmt, "*i32")
            types = {"a_ptr": "*fp16", "b_ptr": b,
                     "scales_ptr": "*fp32" if fmt == "nf4" else "*fp16", "zeros_ptr": "*i32",
                     "g_idx_ptr": "*i32", "quant_map_ptr": "*fp32", "out_ptr": "*fp16",
                     "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
                     "topk_weights_ptr": "*fp32"}
            for mul in (False, True):
                for row_groups in (False, True) if code else (False,):
                    consts = {**cfg.constexprs, "FORMAT": code, "MUL_WEIGHT": mul,
                              "DOT_DTYPE": "tl.float16", "ROW_GROUPS": row_groups}
                    specs.append(AotSpec(f"{moe.__name__}:_moe_matmul_kernel", types, consts,
                                         cfg.num_warps, cfg.num_stages))
    aot_compile_all(specs)


def random_nf4_experts(k: int, n: int, blocksize: int = 64, seed: int = 0) -> moe.ExpertWeights:
    """E experts of random NF4 codes and block absmax in bitsandbytes' layout, stacked."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, n * k // 2), generator=gen, dtype=torch.uint8)
    absmax = (torch.rand(E, n * k // blocksize, generator=gen) + 0.5) / k**0.5
    return moe.ExpertWeights("nf4", packed.to(DEVICE), scales=absmax.to(DEVICE),
                             group_size=blocksize, quant_map=torch.tensor(NF4_CODES).to(DEVICE),
                             shape=(n, k))


def test_nf4_experts_dequantize_as_their_matrices():
    w = random_nf4_experts(128, 96)
    assert w.out_in == (96, 128)
    for e in (0, E - 1):
        one = NF4Weight(w.weight[e].cpu(), w.scales[e].cpu(), w.quant_map.cpu(), (96, 128))
        assert torch.equal(w.dequantize()[e].cpu(), one.dequantize_fp32())
    with pytest.raises(ValueError, match="multiple of the block size"):
        moe.ExpertWeights("nf4", w.weight, scales=w.scales, group_size=64,
                          quant_map=w.quant_map, shape=(96, 96))


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_nf4_experts_in_the_fused_kernel(tokens, monkeypatch):
    """NF4 experts through the fused kernel match the reference, and the tile reading one absmax
    per column (its K tile inside one block) computes what the per-weight gather does."""
    h, inter = 128, 64
    w1, w2 = random_nf4_experts(h, 2 * inter, seed=1), random_nf4_experts(inter, h, seed=2)
    x = torch.randn(tokens, h, device=DEVICE).half()
    weights, ids = routing(tokens, seed=tokens)
    out = moe.fused_moe_triton(x, w1, w2, weights, ids)
    assert out.shape == (tokens, h) and out.dtype == x.dtype
    assert rel_err(out, moe.fused_moe_ref(x, w1, w2, weights, ids)) < 1e-2
    launches = record_launches(monkeypatch, moe, "ROW_GROUPS")
    cfg = moe.DECODE if tokens * TOP_K <= 64 else moe.PREFILL
    sorted_ids, expert_ids = moe.moe_align(ids, E, cfg.block_m)
    rows, gathered = (moe.moe_matmul_triton(x, w1, sorted_ids, expert_ids, tokens * TOP_K, TOP_K,
                                            None, cfg, row_groups=r, tune=False)
                      for r in (True, False))
    assert launches == [True, False]
    assert torch.equal(rows, gathered)
