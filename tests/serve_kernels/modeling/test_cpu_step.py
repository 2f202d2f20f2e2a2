"""Shortcuts of the CPU decode step (fewer operator calls per layer) give the values of the
longer form they replace: rotary by a flip of the halves, routers in fp32, wide 16-bit matrices
in oneDNN's blocked layout, the unmasked attention of equal-length decode rows, the KV store
without its slot check, one token through the packed expert loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.serve_kernels.kernels.helpers import random_gptq
from thresher.serve_kernels.kernels import (
    ExpertWeights,
    cache,
    cpu_attention,
    cpu_blocked,
    cpu_native,
    rotary,
)
from thresher.serve_kernels.kernels.cpu_int4 import int4_matmul, pack_gptq_int4
from thresher.serve_kernels.kernels.cpu_q4 import ExpertTable
from thresher.serve_kernels.modeling import attention
from thresher.serve_kernels.modeling.attention import AttentionMetadata, paged_attention
from thresher.serve_kernels.modeling.decoder import Rope
from thresher.serve_kernels.modeling.linear import NARROW_ROWS, DenseLinear, packed_bytes
from thresher.serve_kernels.modeling.moe import FusedExperts, grouped_moe_packed, grouped_moe_torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotate_is_bit_equal_to_transformers(dtype):
    """The engine rounds cos/sin to the activation dtype and rotates op by op, as transformers
    does; the flip with the sign on sin must not change a bit."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos_sin = rotary.rotary_cos_sin(inv_freq, 128)
    positions = torch.tensor([0, 3, 77, 127])
    x = torch.randn(4, 6, 64).to(dtype)
    ours = Rope(cos_sin, positions, dtype).rotate(x)
    emb = torch.cat([torch.outer(positions.float(), inv_freq)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]
    theirs, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    assert ours.dtype == dtype and torch.equal(ours, theirs[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_16bit_matrix_runs_in_fp32_and_rounds_once(dtype):
    router = DenseLinear(torch.randn(8, 256).to(dtype))
    wide = DenseLinear(torch.randn(NARROW_ROWS + 1, 256).to(dtype))
    fp32 = DenseLinear(torch.randn(8, 256))
    before = packed_bytes(router)
    for layer in (router, wide, fp32):
        layer.pack_for_cpu(dtype)
    assert router.cpu_fp32 is not None and wide.cpu_fp32 is None and fp32.cpu_fp32 is None
    assert packed_bytes(router) == before + 8 * 256 * 4  # the copy is counted
    x = torch.randn(3, 256).to(dtype)
    out = router(x)
    assert out.dtype == dtype
    assert torch.equal(out, F.linear(x.float(), router.weight.float()).to(dtype))
    # the 16-bit GEMM accumulates in fp32 too: at most one rounding apart
    assert torch.allclose(out.float(), F.linear(x, router.weight).float(), rtol=1e-2, atol=1e-2)


def _cache_and_meta(lens: list[int], host_exact: bool, block: int = 4):
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-n // block) for n in lens]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    shape = (sum(blocks) + 2, block, 2, 16)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    first = 1
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.arange(first, first + n)
        first += n
    host = lens if host_exact else [max(lens) + 5] * len(lens)  # a graph's host lists: bounds
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_tables=tables,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32), num_decodes=len(lens),
        query_lens=[1] * len(lens), context_lens_list=host, max_context_len=max(host),
        host_exact=host_exact)
    return k_cache, v_cache, tables, meta


def _decode_path(path: str, monkeypatch) -> None:
    """"c": cpu_attention.c walks the block tables; "operators": gather and SDPA."""
    if path == "operators":
        monkeypatch.setattr(attention, "paged_decode_c", lambda *args: None)
    elif cpu_native.library() is None:
        pytest.skip("no C compiler here, or no AVX2 and FMA")


@pytest.mark.parametrize("lens,host_exact", [([9], True), ([9, 9, 9], True),
                                             ([9, 3, 6], True), ([9, 3, 6], False)])
@pytest.mark.parametrize("path", ["c", "operators"])
def test_decode_attention_with_or_without_mask_matches_each_row(lens, host_exact, path,
                                                               monkeypatch):
    """Equal exact lengths skip the mask; unequal ones, or a graph's bounds, keep it. The C
    path reads the device lengths, exact either way."""
    _decode_path(path, monkeypatch)
    k_cache, v_cache, tables, meta = _cache_and_meta(lens, host_exact)
    if not host_exact:  # the bound reaches past the tables: widen them with unused block 0
        tables = F.pad(tables, (0, 2))
        meta.block_tables = tables
    q = torch.randn(len(lens), 4, 16)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    for b, n in enumerate(lens):
        rows = tables[b, : -(-n // k_cache.shape[1])].long()
        k = k_cache[rows].reshape(-1, 2, 16)[:n].transpose(0, 1)
        v = v_cache[rows].reshape(-1, 2, 16)[:n].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b][:, None], k, v, scale=0.25, enable_gqa=True)
        assert torch.allclose(out[b], ref[:, 0], atol=1e-5)


def _decode_meta(tables: torch.Tensor, lens: list[int]) -> AttentionMetadata:
    """The metadata of one decode token per sequence over ``tables`` with context ``lens``."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_tables=tables,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32), num_decodes=len(lens),
        query_lens=[1] * len(lens), context_lens_list=lens, max_context_len=max(lens))


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler here, or no AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 20, 64, 128, 136])  # widths, a tail, two register passes
def test_decode_attention_c_matches_the_operators(dtype, d):
    """Scattered blocks, grouped heads, lengths across block boundaries and not multiples of 8,
    16-bit caches: the C walk and the gather + SDPA path agree to fp32 rounding (bf16: one
    rounding of the output)."""
    gen = torch.Generator().manual_seed(3)
    lens, block, hq, hkv = [1, 5, 16, 37], 8, 8, 2
    blocks = 40
    k_cache = torch.randn(blocks, block, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(lens), 5, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        k = -(-n // block)
        tables[b, :k] = perm[used : used + k]
        used += k
    meta = _decode_meta(tables, lens)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    got = attention.paged_decode_c(q, k_cache, v_cache, tables, meta.context_lens, d**-0.5,
                                   max(lens))
    assert attention.paged_decode_c(q, k_cache, v_cache, tables, meta.context_lens, d**-0.5,
                                    cpu_attention.MAX_CONTEXT + 1) is None  # SDPA's range
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "paged_decode_c", lambda *args: None)
        want = paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler here, or no AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,lens,window", [
    (8, 2, [1, 5, 16, 37], 0), (8, 2, [1, 5, 16, 37], 4), (8, 2, [1, 5, 16, 37], 16),
    (16, 1, [1000], 0), (16, 1, [1000], 128)])  # one sequence of one kv head: the heads split
def test_decode_attention_c_with_sinks_and_a_window_matches_gpt_oss(dtype, hq, hkv, lens, window):
    """gpt-oss's attention in the C walk: each head's sink logit joins the softmax's denominator
    and a sliding layer sees its last ``window`` positions, as ``gpt_oss.sink_attention``."""
    from thresher.serve_kernels.modeling.gpt_oss import sink_attention

    gen = torch.Generator().manual_seed(5)
    block, d = 8, 64
    per_seq = -(-max(lens) // block)
    blocks = per_seq * len(lens) + 1
    k_cache = torch.randn(blocks, block, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block, hkv, d, generator=gen).to(dtype)
    tables = (torch.randperm(blocks - 1, generator=gen)[: per_seq * len(lens)] + 1).view(
        len(lens), per_seq).to(torch.int32)
    meta = _decode_meta(tables, lens)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    sinks = torch.randn(hq, generator=gen) * 2
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the walk's threads are torch's: two, so that the heads split
    try:
        got = attention.paged_decode_c(q, k_cache, v_cache, tables, meta.context_lens, d**-0.5,
                                       max(lens), sinks=sinks, window=window)
    finally:
        torch.set_num_threads(threads)
    want = sink_attention(q, k_cache, v_cache, meta, d**-0.5, sinks, window or None)
    # bf16: the reference rounds each logit and probability to bf16, the walk keeps them fp32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def test_store_without_the_slot_check_writes_the_same():
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([7, 0, 12, 3, 9])
    caches = [torch.zeros(4, 4, 2, 16) for _ in range(4)]
    cache.store_kv_cache_ref(k, v, caches[0], caches[1], slots)
    cache.store_kv_cache_ref(k, v, caches[2], caches[3], slots, all_stored=True)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_expert_loop_one_token_matches_its_row_of_a_batch(dtype):
    experts, hidden, inter, top_k = 4, 128, 64, 2
    gate_up = [pack_gptq_int4(*random_gptq(hidden, 2 * inter, 32, False, seed=e)[0])
               for e in range(experts)]
    down = [pack_gptq_int4(*random_gptq(inter, hidden, 32, False, seed=10 + e)[0])
            for e in range(experts)]
    x = torch.randn(5, hidden).to(dtype)
    weights, ids = torch.randn(5, experts).softmax(-1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    batch = grouped_moe_packed(x, gate_up, down, int4_matmul, weights, ids)
    for t in range(5):
        one = grouped_moe_packed(x[t : t + 1], gate_up, down, int4_matmul, weights[t : t + 1],
                                 ids[t : t + 1])
        assert one.dtype == dtype
        assert torch.allclose(one.float(), batch[t : t + 1].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler here, or no AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128])
def test_one_token_expert_call_matches_the_operator_path(dtype, group_size):
    """thr_q4_moe_one rounds where the operator path rounds (bf16 gate|up, activation and down
    outputs, fp32 weighted sum), so the two agree but for the activation's exp and the order of
    the fp32 sum: a bf16 output differs by one step on a rare element, an fp32 one in its last
    bits."""
    experts, hidden, inter, top_k = 6, 256, 128, 2
    gate_up = [pack_gptq_int4(*random_gptq(hidden, 2 * inter, group_size, False, seed=e)[0],
                              kernel="q4") for e in range(experts)]
    down = [pack_gptq_int4(*random_gptq(inter, hidden, group_size, False, seed=10 + e)[0],
                           kernel="q4") for e in range(experts)]
    table = ExpertTable.build(gate_up, down)
    assert table is not None and (table.hidden, table.inter) == (hidden, inter)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(1, hidden, generator=gen).to(dtype)
        weights, ids = torch.randn(1, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
        weights = weights.to(dtype)
        got = table(x, weights, ids)
        want = grouped_moe_packed(x, gate_up, down, int4_matmul, weights, ids)
        assert got.dtype == dtype and got.shape == (1, hidden)
        if dtype == torch.bfloat16:
            assert (got != want).float().mean() <= 0.02
            assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-6)
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        table(x, weights, torch.tensor([[0, experts]]))


def test_expert_table_needs_q4_packs():
    gate_up = [pack_gptq_int4(*random_gptq(128, 128, 32, False, seed=e)[0], kernel="torch")
               for e in range(2)]
    down = [pack_gptq_int4(*random_gptq(64, 128, 32, False, seed=e)[0], kernel="torch")
            for e in range(2)]
    assert ExpertTable.build(gate_up, down) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_16bit_matrix_blocked_gives_the_plain_products(dtype, monkeypatch):
    if not cpu_blocked.blocked_supported(dtype):
        pytest.skip(f"this CPU's oneDNN has no {dtype} matmul")
    monkeypatch.setenv(cpu_blocked.ENV_VAR, str(64 * 128))
    weight, bias = torch.randn(64, 128).to(dtype), torch.randn(64).to(dtype)
    layer, tied = DenseLinear(weight.clone(), bias), DenseLinear(weight, tied=True)
    small = DenseLinear(torch.randn(32, 128).to(dtype))  # under the threshold
    for m in (layer, tied, small):
        m.pack_for_cpu(dtype)
    assert layer.cpu_blocked is not None and layer.weight.numel() == 0  # row-major released
    assert tied.cpu_blocked is None and small.cpu_blocked is None
    assert torch.equal(layer.row_major(), weight)
    x = torch.randn(5, 128).to(dtype)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the reference reads the weight back
    assert torch.equal(layer(x), F.linear(x, weight, bias))


def test_blocked_threshold_is_read_at_load(monkeypatch):
    monkeypatch.setenv(cpu_blocked.ENV_VAR, "never")
    assert not cpu_blocked.serve_blocked(torch.randn(1024, 1024).to(torch.bfloat16))
    monkeypatch.setenv(cpu_blocked.ENV_VAR, "lots")
    with pytest.raises(ValueError, match=cpu_blocked.ENV_VAR):
        cpu_blocked.blocked_min_elements()
    monkeypatch.delenv(cpu_blocked.ENV_VAR)
    assert not cpu_blocked.serve_blocked(torch.randn(1024, 1024))  # fp32 stays row-major


def test_blocked_experts_match_the_row_major_loop(monkeypatch):
    if not cpu_blocked.blocked_supported(torch.bfloat16):
        pytest.skip("this CPU's oneDNN has no bf16 matmul")
    monkeypatch.setenv(cpu_blocked.ENV_VAR, "0")
    experts, hidden, inter = 4, 64, 48
    gate_up = torch.randn(experts, 2 * inter, hidden).to(torch.bfloat16) / 8
    down = torch.randn(experts, hidden, inter).to(torch.bfloat16) / 8
    fused = FusedExperts("dense", {"weight": gate_up.clone()}, {"weight": down.clone()})
    fused.pack_for_cpu(torch.bfloat16)
    assert fused.cpu_matmul is cpu_blocked.blocked_matmul and fused.gate_up_weight.numel() == 0
    x = torch.randn(6, hidden).to(torch.bfloat16)
    weights, ids = torch.randn(6, experts).softmax(-1).topk(2, dim=-1)
    weights = weights.to(torch.bfloat16)
    want = grouped_moe_torch(x, ExpertWeights("dense", gate_up), ExpertWeights("dense", down),
                             weights, ids)
    for rows in (slice(0, 6), slice(2, 3)):  # a batch, and one token
        got = fused(x[rows], weights[rows], ids[rows])
        assert torch.allclose(got.float(), want[rows].float(), rtol=1e-2, atol=1e-2)
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the reference reads the experts back
    assert torch.equal(fused(x, weights, ids), want)
