"""Decode attention over the paged KV cache in one C call (cpu_attention.c), for CPU decode steps.

Where every scheduled sequence has one new token, the operator path (block gather, views,
``scaled_dot_product_attention``) costs a dozen dispatched operators, 45-70 us per layer at
batch 1 for a short context; the C function walks the block tables directly, each kv head's
keys and values read once for the query heads that share them. Same math in fp32 (scores, softmax, weighted values), rounded
once to the activation dtype. Measured against the operator path with the caches coming from
memory (``benchmarks/engine/cpu_attention.py``; bf16, batch 1): 1.6-2.4x its speed at 256
cached tokens, 1.7-2.8x at 1,024 and 2.3-3.3x from 2,048 to 16,384, on one and two threads.
Contexts past ``MAX_CONTEXT`` keep the operators: the walk's score buffers (a float per head and
position) would grow past a few MB per thread.
Returns None where it does not apply (no library loaded, fp16, a non-contiguous tensor), and the
caller keeps the operator path.
"""

from __future__ import annotations

import torch

from thresher.serve_kernels.kernels.cpu_native import loaded

DTYPES = (torch.float32, torch.bfloat16)
MAX_CONTEXT = 131072  # longest cached sequence the C walk takes (see above)


def paged_decode_c(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                   max_context: int, sinks: torch.Tensor | None = None, window: int = 0
                   ) -> torch.Tensor | None:
    """q [B, Hq, D] (one token per sequence) -> [B, Hq, D]; caches [blocks, block, Hkv, D],
    block tables [B, max_blocks] and context lengths [B] as int32; ``max_context`` the longest
    length (host-side). ``sinks`` (fp32 [Hq]) and ``window`` (0: none): gpt-oss's per-head sink
    logits and sliding window, as the C decode step runs them."""
    lib = loaded()
    if (lib is None or max_context > MAX_CONTEXT or q.dtype not in DTYPES or k_cache.dtype != q.dtype
            or v_cache.dtype != q.dtype or block_tables.dtype != torch.int32
            or context_lens.dtype != torch.int32 or block_tables.stride(1) != 1
            or not all(t.is_contiguous() for t in (q, k_cache, v_cache, context_lens))):
        return None
    batch, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv or k_cache.shape[3] != d:
        return None
    out = torch.empty_like(q)
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), context_lens.data_ptr(), batch, hq, hkv, d, k_cache.shape[1],
            scale)
    if sinks is None and not window:
        rc = lib.thr_paged_decode(*args, out.data_ptr(), int(q.dtype == torch.bfloat16))
    else:
        sinks = None if sinks is None else sinks.float().contiguous()
        rc = lib.thr_paged_decode_sinks(*args, None if sinks is None else sinks.data_ptr(),
                                        window, out.data_ptr(), int(q.dtype == torch.bfloat16))
    if rc:
        raise MemoryError("cpu_attention: out of memory for the score buffers")
    return out
