"""Writing new keys and values into the paged KV cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] per layer for K and for V. The
engine's block manager gives every new token a slot = block * block_size + offset; slot -1 marks
a token whose K/V must not be stored (padding, or a prefix already cached).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thresher.serve_kernels.kernels.backend import launcher, use_triton


def store_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, all_stored: bool = False,
) -> None:
    """``all_stored``: the caller knows no slot is -1 (the check is a host sync per layer)."""
    slots = slot_mapping if slot_mapping.dtype == torch.long else slot_mapping.long()
    if not all_stored:
        keep = slots >= 0
        if not bool(keep.all()):  # boolean indexing only when some rows store nothing
            slots, k, v = slots[keep], k[keep], v[keep]
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


@triton.jit
def _store_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_k, stride_v, width,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * width + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * width + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    tokens = k.shape[0]
    width = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(tokens, width), v.reshape(tokens, width)  # copies only if heads are strided
    if tokens:
        launcher(_store_kv_cache_kernel, k)[(tokens,)](
            k2, v2, k_cache, v_cache, slot_mapping.contiguous(), k2.stride(0), v2.stride(0),
            width, BLOCK=triton.next_power_of_2(width),
        )


def store_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, all_stored: bool = False,
) -> None:
    """k, v [tokens, kv_heads, D] -> the caches at ``slot_mapping`` [tokens] (in place);
    ``all_stored`` says no slot is -1 (the reference then skips its check)."""
    if use_triton(k):
        store_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, all_stored)
