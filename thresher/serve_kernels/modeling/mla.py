"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a latent paged cache.

MLA compresses each token's keys and values into one ``kv_lora_rank`` latent c (after
``kv_a_layernorm``) plus one ``qk_rope_head_dim`` rotary key shared by every head; ``kv_b_proj``
expands c into per-head non-rotary keys and values. The cache keeps only [c, k_rope] per token
and layer (one "head" of kv_lora_rank + qk_rope_head_dim: 576 values for DeepSeek-V3, against
128 heads x (192 + 128) expanded), as vLLM and llama.cpp keep it.

kv_b is absorbed rather than expanded (vLLM's decode path, llama.cpp's ``attn_k_b``/``attn_v_b``):
for head h, q_nope . (W_kb[h] c) = (W_kb[h]^T q_nope) . c, so the query moves into latent space
once per new token, and the attention output sum_l p_l W_vb[h] c_l = W_vb[h] (sum_l p_l c_l) leaves
it once. Attention is then grouped-query attention with one kv head over the cache itself, which
the existing paged kernels run unchanged (values = the cache rows; their rotary tail is dropped
after). Expanding instead costs kv_b's matmul over every cached token at every step
(L x kv_lora_rank x heads x (nope + v) per layer: 17 GFLOP at L = 1000 on DeepSeek-V3, against
heads x L x (kv_lora_rank + rope) x 2 = 0.15 GFLOP absorbed; measured 31x slower at L = 1024,
benchmarks/engine/mla_absorb.py), so absorption is the choice for decode; a prefill chunk takes
the same path, which keeps one cache layout and one code path.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from thresher.serve_kernels.kernels import apply_rotary, rms_norm, store_kv_cache
from thresher.serve_kernels.kernels.backend import use_triton
from thresher.serve_kernels.modeling.attention import AttentionMetadata, paged_attention
from thresher.serve_kernels.modeling.decoder import Rope
from thresher.serve_kernels.modeling.linear import Linear, merge_linears

LOW_RANK_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with it


def softmax_scale(config) -> float:
    """(qk_nope + qk_rope)^-1/2, times yarn's mscale squared when ``mscale_all_dim`` is set
    (DeepSeek-V3: factor 40, mscale_all_dim 1)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or {}
    mscale_all_dim = rope.get("mscale_all_dim", 0)
    factor = rope.get("factor", 1.0)
    if rope.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """MLA self-attention; the cache of each layer is one tensor [blocks, block_size, 1,
    kv_lora_rank + qk_rope_head_dim]."""

    def __init__(self, config, q_a_proj: Linear | None, q_a_norm: torch.Tensor | None,
                 q_proj: Linear, kv_a_proj: Linear, kv_a_norm: torch.Tensor, kv_b: torch.Tensor,
                 o_proj: Linear):
        """``q_proj`` is q_b_proj when the config has a query rank (``q_a_proj`` and
        ``q_a_norm`` given), the full query projection otherwise; ``kv_b`` is kv_b_proj's dense
        (dequantized) weight [heads x (nope + v), kv_lora_rank]."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.q_rank = 0 if q_a_proj is None else q_a_proj.out_features
        # both down projections read the layer input: one matmul
        self.down = merge_linears([kv_a_proj] if q_a_proj is None else [q_a_proj, kv_a_proj])
        self.q_proj, self.o_proj = q_proj, o_proj
        self.register_buffer("q_a_norm", q_a_norm)
        self.register_buffer("kv_a_norm", kv_a_norm)
        per_head = kv_b.view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.register_buffer("w_kb", per_head[:, : self.nope].contiguous())  # [H, nope, r]
        self.register_buffer("w_vb", per_head[:, self.nope :].contiguous())  # [H, v, r]
        self.interleaved = bool(getattr(config, "rope_interleave", False))
        self.scale = softmax_scale(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        down = self.down(x)
        if self.q_rank:
            q_low, down = down.split([self.q_rank, down.shape[-1] - self.q_rank], dim=-1)
            q = self.q_proj(rms_norm(q_low.contiguous(), self.q_a_norm, LOW_RANK_NORM_EPS))
        else:
            q = self.q_proj(x)
        q_nope, q_rot = q.view(tokens, heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = down.split([self.rank, self.rope_dim], dim=-1)
        latent = rms_norm(latent.contiguous(), self.kv_a_norm, LOW_RANK_NORM_EPS)
        q_rot, k_rot = self._rotate(q_rot, k_rot.reshape(tokens, 1, self.rope_dim), positions, rope)
        query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, self.w_kb), q_rot], dim=-1)
        entry = torch.cat([latent.unsqueeze(1), k_rot], dim=-1)  # [T, 1, r + rope]
        (cache,) = kv_cache
        # one tensor holds keys and values: the store's K and V writes are the same row
        store_kv_cache(entry, entry, cache, cache, meta.slot_mapping, all_stored=meta.host_exact)
        o = paged_attention(query, cache, cache, meta, self.scale)[..., : self.rank]
        o = torch.einsum("thr,hvr->thv", o, self.w_vb)
        return self.o_proj(o.reshape(tokens, heads * self.v_dim))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: Rope
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary on the decoupled parts. DeepSeek's checkpoints pair channels (0, 1), (2, 3),
        ... (``rope_interleave``); transformers rotates them as the halves [evens, odds], which
        is rotate-half rope on the de-interleaved channels (dot products do not see the order)."""
        if self.interleaved:
            q = torch.cat([q[..., 0::2], q[..., 1::2]], dim=-1)
            k = torch.cat([k[..., 0::2], k[..., 1::2]], dim=-1)
        if use_triton(q):
            return apply_rotary(q.contiguous(), k.contiguous(), positions, rope.cos_sin)
        return rope.rotate(q.contiguous()), rope.rotate(k.contiguous())
