"""Paged KV cache store, decode and prefill attention: references against PyTorch's SDPA on the
dense (unpaged) K/V, Triton kernels against the references, AOT builds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.serve_kernels.kernels.helpers import DEVICE, AotSpec, aot_compile_all, rel_err
from thresher.serve_kernels.kernels import attention, cache

BLOCK_SIZE, KV_HEADS, Q_HEADS, DIM = 16, 2, 6, 48  # GQA group 3; DIM masked to 64
CONTEXT = [5, 37, 70]  # not multiples of the 16-token blocks nor of the 64-token steps
SCALE = DIM**-0.5


def paged(dtype=torch.float16, seed=0):
    """Dense per-sequence K/V, and the same stored in shuffled cache blocks via a slot mapping."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // BLOCK_SIZE) for n in CONTEXT]
    num_blocks = sum(blocks_needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(CONTEXT), max(blocks_needed), dtype=torch.int32)
    ks, vs, slots = [], [], []
    for b, n in enumerate(CONTEXT):
        table = [pool.pop() for _ in range(blocks_needed[b])]
        tables[b, : len(table)] = torch.tensor(table)
        ks.append(torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype))
        vs.append(torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    cache.store_kv_cache_ref(torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.tensor(slots))
    lens = torch.tensor(CONTEXT, dtype=torch.int32)
    to = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    return to(k_cache, v_cache, tables, lens), ks, vs


def sdpa(q, k, v, q_len):
    """Causal attention of the last q_len positions, dense K/V, via PyTorch's SDPA."""
    group = Q_HEADS // KV_HEADS
    k, v = (t.float().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    n = k.shape[1]
    mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask,
                                         scale=SCALE)
    return out.transpose(0, 1)


def test_store_kv_cache_triton_matches_ref():
    k = torch.randn(9, KV_HEADS, DIM, device=DEVICE).half()
    v = torch.randn(9, KV_HEADS, DIM, device=DEVICE).half()
    slots = torch.tensor([3, -1, 40, 17, 0, -1, 63, 22, 5], device=DEVICE)
    caches = [torch.zeros(4, BLOCK_SIZE, KV_HEADS, DIM, device=DEVICE).half() for _ in range(4)]
    cache.store_kv_cache_ref(k, v, caches[0], caches[1], slots)
    cache.store_kv_cache_triton(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[0].view(-1, KV_HEADS, DIM)
    assert torch.equal(flat[40], k[2]) and flat[1].abs().sum() == 0  # slot 1 never written


def test_decode_ref_matches_sdpa():
    (k_cache, v_cache, tables, lens), ks, vs = paged(torch.float32)
    q = torch.randn(len(CONTEXT), Q_HEADS, DIM, device=DEVICE)
    out = attention.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, SCALE)
    for b in range(len(CONTEXT)):
        assert rel_err(out[b], sdpa(q[b : b + 1].cpu(), ks[b], vs[b], 1)[0]) < 1e-5


def test_prefill_ref_matches_sdpa():
    (k_cache, v_cache, tables, lens), ks, vs = paged(torch.float32)
    q_lens = [5, 10, 33]  # the first sequence has no cached prefix
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), Q_HEADS, DIM, device=DEVICE)
    out = attention.paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu.to(DEVICE),
                                                lens, SCALE)
    for b, n in enumerate(q_lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        assert rel_err(out[rows], sdpa(q[rows].cpu(), ks[b], vs[b], n)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 2e-2),
                                       (torch.float32, 1e-5)])
def test_decode_triton_matches_ref(dtype, tol):
    (k_cache, v_cache, tables, lens), _, _ = paged(dtype)
    q = torch.randn(len(CONTEXT), Q_HEADS, DIM, device=DEVICE).to(dtype)
    out = attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, SCALE)
    ref = attention.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, SCALE)
    assert out.dtype == dtype and rel_err(out, ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.float32, 1e-5)])
def test_prefill_triton_matches_ref(dtype, tol):
    (k_cache, v_cache, tables, lens), _, _ = paged(dtype)
    cu = torch.tensor([0, 5, 15, 48], dtype=torch.int32, device=DEVICE)  # 33 rows: 2 tiles
    q = torch.randn(48, Q_HEADS, DIM, device=DEVICE).to(dtype)
    out = attention.paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, lens, SCALE)
    ref = attention.paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, SCALE)
    assert out.dtype == dtype and rel_err(out, ref) < tol


def test_aot_compiles():
    types = {"q_ptr": "*fp16", "k_cache_ptr": "*fp16", "v_cache_ptr": "*fp16",
             "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
             "out_ptr": "*fp16", "scale": "fp32"}
    shapes = {"HEAD_DIM": 128, "DOT_DTYPE": "tl.float16", "BLOCK_D": 128,
              "BLOCK_N": attention.BLOCK_N}
    specs = []
    for group in (1, 8):  # MHA (OLMoE) and the widest GQA group we serve (Qwen3-MoE)
        specs.append(AotSpec(f"{attention.__name__}:_decode_kernel", types,
                             {**shapes, "GROUP": group, "BLOCK_G": 16}))
    specs.append(AotSpec(f"{attention.__name__}:_prefill_kernel", types,
                         {**shapes, "GROUP": 4, "BLOCK_M": attention.PREFILL_BLOCK_M}))
    specs.append(AotSpec(f"{cache.__name__}:_store_kv_cache_kernel",
                         {"k_ptr": "*fp16", "v_ptr": "*fp16", "k_cache_ptr": "*fp16",
                          "v_cache_ptr": "*fp16", "slot_mapping_ptr": "*i64"}, {"BLOCK": 1024}))
    split_types = {**types, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    specs.append(AotSpec(f"{attention.__name__}:_decode_split_kernel", split_types,
                         {**shapes, "DOT_DTYPE": "tl.bfloat16", "PARTITION": attention.PARTITION,
                          "GROUP": 8, "BLOCK_G": 16}))
    specs.append(AotSpec(f"{attention.__name__}:_decode_merge_kernel", split_types,
                         {"HEAD_DIM": 128, "PARTITION": attention.PARTITION, "BLOCK_S": 64,
                          "BLOCK_D": 128}))
    aot_compile_all(specs)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.float32, 1e-5)])
def test_split_kv_decode_matches_ref(dtype, tol):
    """64-token partitions over contexts 5, 37, 70: one sequence spans two, two leave the second
    partition empty (weight 0 in the merge)."""
    (k_cache, v_cache, tables, lens), _, _ = paged(dtype)
    q = torch.randn(len(CONTEXT), Q_HEADS, DIM, device=DEVICE).to(dtype)
    assert attention.decode_splits(len(CONTEXT), KV_HEADS, max(CONTEXT), 64) == 2
    out = attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, SCALE,
                                                  max_context_len=max(CONTEXT), partition=64)
    ref = attention.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, SCALE)
    assert out.dtype == dtype and rel_err(out, ref) < tol


def test_split_kv_decode_reads_only_the_real_context():
    """Sized for a long max_model_len (as a CUDA graph is), the partitions past each sequence's
    end neither write their partial results nor are read by the merge: NaN-filled buffers stay
    NaN there and the output is still exact."""
    (k_cache, v_cache, tables, lens), _, _ = paged(torch.float32)
    q = torch.randn(len(CONTEXT), Q_HEADS, DIM, device=DEVICE)
    splits = attention.decode_splits(len(CONTEXT), KV_HEADS, 4096, 32)
    assert splits == 128
    parts = (torch.full((len(CONTEXT), splits, Q_HEADS, DIM), float("nan"), device=DEVICE),
             torch.full((len(CONTEXT), splits, Q_HEADS), float("nan"), device=DEVICE))
    out = attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, SCALE,
                                                  max_context_len=4096, partition=32, parts=parts)
    ref = attention.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, SCALE)
    assert rel_err(out, ref) < 1e-5
    for b, n in enumerate(CONTEXT):
        used = -(-n // 32)
        assert not parts[1][b, :used].isnan().any() and parts[1][b, used:].isnan().all()
        assert parts[0][b, used:].isnan().all()


def test_decode_splits_from_host_sizes():
    assert attention.decode_splits(1, 4, None) == 1  # no host bound: the one-pass kernel
    assert attention.decode_splits(1, 4, 4096) == 4096 // attention.PARTITION
    assert attention.decode_splits(64, 4, 4096) == 1  # enough programs without splitting
