"""Attention over the paged KV cache: decode (one new token per sequence) and causal prefill.

Both read K/V through each sequence's block table from caches of shape
[num_blocks, block_size, num_kv_heads, head_dim] (see cache.py), with grouped-query attention
(num_q_heads a multiple of num_kv_heads). Softmax is computed online in fp32 (flash-attention
style), so no [queries, context] score matrix is ever materialized.

Decode: q [B, Hq, D], context_lens [B] (tokens in the cache, including the new one).
One program per (sequence, kv head) handles that kv head's whole group of query heads, so each
K/V byte is read once per group: decode attention is bound by reading the cache. With few
sequences that is too few programs to keep a GPU's SMs reading, so the split-KV variant also
splits the context into partitions of ``PARTITION`` tokens (flash-decoding): each program writes
its partition's normalized output and log-sum-exp, and a second kernel merges the partitions.
The number of partitions comes from the host-side longest context (or ``max_model_len`` for a
CUDA graph), never from the device; partitions past a sequence's end are empty.

Prefill is varlen: the new tokens of all sequences packed as q [total_q, Hq, D], sequence b
owning rows cu_seqlens_q[b]:cu_seqlens_q[b+1]. Its K/V (already stored with store_kv_cache) are
read from the cache too, so a prefix cached earlier (prefix caching, chunked prefill) is attended
to: with q_len new tokens and context_lens[b] tokens in all, new token i sits at position
context_lens[b] - q_len + i and attends to cache positions 0 .. that position (causal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thresher.serve_kernels.kernels.backend import DOT_PRECISION, dot_dtype, launcher, use_triton

BLOCK_N = 64  # context tokens per step
PREFILL_BLOCK_M = 32  # queries per prefill program
PARTITION = 512  # context tokens per split-KV decode program (a multiple of BLOCK_N)
SPLIT_BELOW_PROGRAMS = 256  # split KV only while sequences x kv heads leave SMs idle


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length].float()  # [length, Hkv, D]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        k = _gather_kv(k_cache, block_tables[b], length)
        v = _gather_kv(v_cache, block_tables[b], length)
        out[b] = _attend(q[b : b + 1], k, v, scale, None)[0].to(q.dtype)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, length in enumerate(context_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        k = _gather_kv(k_cache, block_tables[b], length)
        v = _gather_kv(v_cache, block_tables[b], length)
        pos = torch.arange(length - (end - start), length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        out[start:end] = _attend(q[start:end], k, v, scale, mask).to(q.dtype)
    return out


@triton.jit
def _attend_paged(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, lo, hi, scale,
                  stride_bt, num_kv_heads, block_size, HEAD_DIM: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Online softmax of one sequence's query group over its cached positions [lo, hi): the
    running max ``m``, denominator and unnormalized output (shared by both decode kernels)."""
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        mask_n = pos < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=mask_n,
                        other=0).to(tl.int64)
        row = ((block * block_size + pos % block_size) * num_kv_heads + kv_head) * HEAD_DIM
        mask_nd = mask_n[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(tl.float32).to(DOT_DTYPE)),
                   input_precision=DOT_PRECISION) * scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(tl.float32).to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m = m_new
    return m, denom, acc


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale, stride_qb, stride_bt, num_kv_heads, block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    length = tl.load(context_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_gd = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask_gd, other=0.0).to(tl.float32)
    m, denom, acc = _attend_paged(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head,
                                  0, length, scale, stride_bt, num_kv_heads, block_size,
                                  HEAD_DIM, DOT_DTYPE, BLOCK_G, BLOCK_D, BLOCK_N)
    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_gd)


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr,
    part_lse_ptr, scale, stride_qb, stride_bt, num_kv_heads, block_size, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr, PARTITION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(context_lens_ptr + seq)
    lo = split * PARTITION
    # A partition past the sequence's end does nothing: under a CUDA graph the grid is sized for
    # max_model_len, and the merge reads only the partitions the real context needs.
    if lo < length:
        hi = tl.minimum(lo + PARTITION, length)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_gd = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
        heads = kv_head * GROUP + offs_g
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_gd, other=0.0).to(tl.float32)
        m, denom, acc = _attend_paged(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
                                      kv_head, lo, hi, scale, stride_bt, num_kv_heads,
                                      block_size, HEAD_DIM, DOT_DTYPE, BLOCK_G, BLOCK_D, BLOCK_N)
        out = acc / denom[:, None]
        lse = m + tl.log(denom)
        row_part = (seq * num_splits + split) * (num_kv_heads * GROUP) + heads  # [B, S, Hq]
        tl.store(part_out_ptr + row_part[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=mask_gd)
        tl.store(part_lse_ptr + row_part, lse, mask=offs_g < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, context_lens_ptr, out_ptr, stride_qb, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(context_lens_ptr + seq), PARTITION)  # partitions holding context
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = (offs_s < num_splits) & (offs_s < used)
    rows = (seq * num_splits + offs_s) * num_heads + head
    lse = tl.load(part_lse_ptr + rows, mask=mask_s, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))
    parts = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + seq * stride_qb + head * HEAD_DIM + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    out_ptr, scale, stride_qt, stride_bt, num_kv_heads, block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    length = tl.load(context_lens_ptr + seq)
    prefix = length - q_len
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_md = (offs_m[:, None] < q_len) & mask_d[None, :]
    q_rows = (q_start + offs_m).to(tl.int64) * stride_qt + head * HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=mask_md, other=0.0)
    q = q.to(tl.float32)
    q_pos = prefix + offs_m
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = tl.minimum(length, prefix + (tile + 1) * BLOCK_M)  # causal: nothing past the last query
    for start in range(0, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=mask_n,
                        other=0).to(tl.int64)
        row = ((block * block_size + pos % block_size) * num_kv_heads + kv_head) * HEAD_DIM
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(tl.float32).to(DOT_DTYPE)),
                   input_precision=DOT_PRECISION) * scale
        s = tl.where(mask_n[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(tl.float32).to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + q_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_md)


def _shape_constexprs(q: torch.Tensor, k_cache: torch.Tensor) -> dict:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return {"GROUP": q.shape[1] // num_kv_heads, "HEAD_DIM": head_dim,
            "DOT_DTYPE": dot_dtype(q), "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
            "BLOCK_N": BLOCK_N}


def decode_splits(batch: int, num_kv_heads: int, max_context_len: int | None,
                  partition: int | None = None) -> int:
    """KV partitions per sequence for a decode batch, from host-side sizes only (1 = no split)."""
    if not max_context_len or batch * num_kv_heads >= SPLIT_BELOW_PROGRAMS:
        return 1
    return triton.cdiv(max_context_len, partition or PARTITION)


def paged_decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, max_context_len: int | None = None,
    partition: int | None = None, parts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention; split-KV over ``partition``-token pieces when ``decode_splits`` says so.

    ``max_context_len`` is an upper bound on ``context_lens`` known on the host (the longest
    context of the batch, or ``max_model_len`` when a CUDA graph is captured). The grid covers
    that bound, but partitions past a sequence's own length neither compute nor store, and the
    merge reads only the ones its length fills, so a graph sized for ``max_model_len`` moves
    the bytes of the real contexts. ``parts``: the partial-result buffers (out [B, S, Hq, D] and
    lse [B, S, Hq], fp32) to use instead of fresh ones."""
    q = q.contiguous()
    out = torch.empty_like(q)
    consts = _shape_constexprs(q, k_cache)
    batch, num_heads, num_kv_heads = q.shape[0], q.shape[1], k_cache.shape[2]
    if not batch:
        return out
    block_g = max(16, triton.next_power_of_2(consts["GROUP"]))
    partition = partition or PARTITION
    splits = decode_splits(batch, num_kv_heads, max_context_len, partition)
    if splits == 1:
        launcher(_decode_kernel, q)[(batch, num_kv_heads)](
            q, k_cache, v_cache, block_tables, context_lens, out, scale, q.stride(0),
            block_tables.stride(0), num_kv_heads, k_cache.shape[1], BLOCK_G=block_g, **consts,
        )
        return out
    if parts is None:
        parts = (torch.empty(batch, splits, num_heads, q.shape[2], device=q.device,
                             dtype=torch.float32),
                 torch.empty(batch, splits, num_heads, device=q.device, dtype=torch.float32))
    part_out, part_lse = parts
    launcher(_decode_split_kernel, q)[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse, scale, q.stride(0),
        block_tables.stride(0), num_kv_heads, k_cache.shape[1], splits, PARTITION=partition,
        BLOCK_G=block_g, **consts,
    )
    launcher(_decode_merge_kernel, q)[(batch, num_heads)](
        part_out, part_lse, context_lens, out, q.stride(0), num_heads, splits,
        HEAD_DIM=consts["HEAD_DIM"], PARTITION=partition, BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=consts["BLOCK_D"],
    )
    return out


def paged_prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    q = q.contiguous()
    out = torch.empty_like(q)
    if max_q_len is None:  # reads the device; the engine passes its host-side value instead
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if q.shape[0] else 0
    grid = (triton.cdiv(max_q_len, PREFILL_BLOCK_M), context_lens.shape[0], q.shape[1])
    if q.shape[0]:
        launcher(_prefill_kernel, q)[grid](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale,
            q.stride(0), block_tables.stride(0), k_cache.shape[2], k_cache.shape[1],
            BLOCK_M=PREFILL_BLOCK_M, **_shape_constexprs(q, k_cache),
        )
    return out


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, max_context_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence against its cached context, on the selected backend
    (``max_context_len``: host-side bound on ``context_lens`` that enables split-KV)."""
    if use_triton(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, max_context_len)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of the new tokens over their cached context, selected backend.

    ``max_q_len`` (the longest sequence's new tokens, known on the host) sizes the Triton grid
    without reading ``cu_seqlens_q`` back from the device."""
    if use_triton(q):
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                              context_lens, scale, max_q_len)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                       context_lens, scale)
