"""The engine's decoder-only transformer, shared by every supported family.

Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Llama, Qwen2 and Qwen3 are one layout (pre-norm RMSNorm,
rotary GQA attention, SwiGLU MLP or MoE) with a few switches, all read from the checkpoint or the
config by the loader rather than from the family name: q/k RMSNorm per head (Qwen3) or over the
full projection width (OLMoE), q/k/v biases (Qwen2, GLM-4.5), a shared expert with a sigmoid
gate (Qwen2-MoE) or without one (GLM-4.5), top-k renormalization, ``clip_qkv`` (OLMoE), dense
layers inside an MoE, rotary over the first part of each head only (GLM-4.5's partial rotary),
sigmoid routing with a correction bias and expert groups (GLM-4.5), rotary over interleaved
channel pairs (ERNIE-4.5: q and k de-interleaved per head first, which leaves their dot products
as they were), softmax routing with a selection bias (ERNIE-4.5). Latent attention
(DeepSeek-V3) is ``mla.LatentAttention`` in the attention's place, chosen by the loader from the
family's adapter; so are Qwen3.5-MoE's Gated DeltaNet and gated attention (``deltanet``).

The model works on a flat batch of new tokens ([T] ids and positions) and reads and writes the
paged KV cache, so any mix of prefill chunks and decode tokens runs in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from thresher.serve_kernels.kernels import apply_rotary, rms_norm, silu_and_mul, store_kv_cache
from thresher.serve_kernels.kernels.backend import use_cpu_kernels, use_triton
from thresher.serve_kernels.modeling.attention import AttentionMetadata, paged_attention
from thresher.serve_kernels.modeling.linear import Linear, merge_linears
from thresher.serve_kernels.modeling.native_step import NativeStep, enabled


@dataclass(frozen=True)
class ModelSpec:
    """Shapes the engine needs to size the KV cache and the sampler."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    # cache tensors per layer, each [blocks, block_size, num_kv_heads, head_dim]: K and V (2), or
    # latent attention's one [c, k_rope] row per token (1, with 1 x (kv_lora_rank + rope dim))
    kv_tensors: int = 2
    # layers that keep a recurrent state instead of a KV cache (Qwen3.5's Gated DeltaNet)
    recurrent_layers: tuple[int, ...] = ()

    @property
    def kv_layers(self) -> int:
        """Layers that read and write the paged KV cache."""
        return self.num_layers - len(self.recurrent_layers)


class Attention(nn.Module):
    """Rotary GQA self-attention over the paged KV cache.

    q, k and v travel as one [T, Hq + 2 Hkv, D] tensor (a single matmul when the three weights
    are 16-bit), so norms, clipping and rotary run once on the joint tensor on a CPU.
    """

    def __init__(self, spec: ModelSpec, q_proj: Linear, k_proj: Linear, v_proj: Linear,
                 o_proj: Linear, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, clip_qkv: float | None = None,
                 rotary_dim: int | None = None, interleaved_rotary: bool = False):
        super().__init__()
        self.qkv = merge_linears([q_proj, k_proj, v_proj])
        self.o_proj = o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = (spec.num_heads, spec.num_kv_heads,
                                                            spec.head_dim)
        self.per_head_norm = q_norm is not None and q_norm.numel() == spec.head_dim
        self.register_buffer("q_norm", q_norm)
        self.register_buffer("k_norm", k_norm)
        joint = None
        if self.per_head_norm:  # one weight row per head of the joint q|k tensor
            joint = torch.cat([q_norm.expand(self.num_heads, -1),
                               k_norm.expand(self.num_kv_heads, -1)]).float()  # norm's fp32
        self.register_buffer("qk_norm", joint)
        self.clip_qkv = clip_qkv
        self.rotary_dim = spec.head_dim if rotary_dim is None else rotary_dim
        self.interleaved_rotary = interleaved_rotary
        self.eps = spec.rms_norm_eps
        self.scale = spec.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.project(x)
        if self.q_norm is not None and not self.per_head_norm:  # over the full width (OLMoE)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            qkv = torch.cat([rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps),
                             v], dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        tokens = x.shape[0]
        qkv = qkv.view(tokens, hq + 2 * hkv, d)
        qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
        if self.interleaved_rotary:  # pairs (0, 1), (2, 3), ... -> halves (0, 2, ...), (1, 3, ...)
            qk = qk.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(tokens, hq + hkv, d)
        if use_triton(x):
            q, k = qk[:, :hq], qk[:, hq:]
            if self.per_head_norm:
                q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
            q, k = self._partial(lambda q, k: apply_rotary(q, k, positions, rope.cos_sin), q, k)
        else:
            if self.per_head_norm:
                qk = rms_norm(qk, self.qk_norm, self.eps)
            (qk,) = self._partial(lambda x: (rope.rotate(x),), qk)
            q, k = qk.split([hq, hkv], dim=1)
        k_cache, v_cache = kv_cache
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, all_stored=meta.host_exact)
        o = self.attend(q, k_cache, v_cache, meta)
        return self.o_proj(self.gate_output(o.reshape(tokens, hq * d)))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """q|k|v [T, (Hq + 2 Hkv) D] of the new tokens (gated attention: the gate set apart)."""
        return self.qkv(x)

    def gate_output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output before o_proj (gated attention multiplies by its gate)."""
        return o

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Paged attention of the rotated queries over the cache (sinks: ``gpt_oss``)."""
        return paged_attention(q, k_cache, v_cache, meta, self.scale)

    def _partial(self, rotate, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``rotate`` applied to the first ``rotary_dim`` channels of each head of ``xs``
        [T, heads, D]; the other channels pass through (all of them rotate in most families)."""
        r = self.rotary_dim
        if r == self.head_dim:
            return rotate(*xs)
        rotated = rotate(*(x[..., :r].contiguous() for x in xs))
        return tuple(torch.cat([y, x[..., r:]], dim=-1) for y, x in zip(rotated, xs, strict=True))


class Rope:
    """Rotary angles of one batch, gathered once per forward and shared by every layer.

    The CPU path rotates in the activation dtype with cos/sin rounded to it, as transformers does
    (fp32 angles would upcast q and k, and attention then mixes fp32 queries with a 16-bit cache).
    """

    def __init__(self, cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        self.cos_sin = cos_sin
        if not use_triton(positions):
            cos, sin = cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
            # full width, the sign of rotate_half folded into sin: [cos, cos] and [-sin, sin]
            self.cos, self.sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``apply_rotary``'s math on x [T, heads, D] (the CPU path): x * cos + rotate_half(x)
        * sin, with rotate_half(x) = [-x2, x1] as [x2, x1] * [-1, 1] (a flip of the halves; the
        sign rides on sin, which is exact), rounded op by op as transformers rounds it."""
        t, h, d = x.shape
        swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
        return x * self.cos + swapped * self.sin


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x)."""

    def __init__(self, gate_proj: Linear, up_proj: Linear, down_proj: Linear):
        super().__init__()
        self.gate_up = merge_linears([gate_proj, up_proj])
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the following RMSNorm."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, input_norm: torch.Tensor,
                 post_attention_norm: torch.Tensor, eps: float):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.register_buffer("input_norm", input_norm)
        self.register_buffer("post_attention_norm", post_attention_norm)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: Rope, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = rms_norm(x, self.input_norm, self.eps, residual)
        h = self.attn(h, positions, rope, kv_cache, meta)
        h, residual = rms_norm(h, self.post_attention_norm, self.eps, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head, over packed new tokens."""

    def __init__(self, spec: ModelSpec, embed_tokens: torch.Tensor, layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: Linear, cos_sin: torch.Tensor):
        super().__init__()
        self.spec = spec
        self.register_buffer("embed_tokens", embed_tokens)
        self.layers = nn.ModuleList(layers)
        self.register_buffer("norm", norm)
        self.lm_head = lm_head
        self.register_buffer("cos_sin", cos_sin)
        # whether decode may replay CUDA graphs (not with attention that reads host lengths)
        self.graph_safe = not any(getattr(layer.attn, "reads_host_lengths", False)
                                  for layer in layers)
        # whether some layer carries a per-sequence recurrent state (Qwen3.5's Gated DeltaNet):
        # its tokens can be neither skipped (prefix caching) nor taken back (speculation)
        self.recurrent = any(getattr(layer.attn, "recurrent", False) for layer in layers)
        self.native_step: NativeStep | None = None  # one C call per CPU decode step (loader)

    def reserve_states(self, slots: int) -> int:
        """Allocate every recurrent layer's per-sequence state for ``slots`` sequences now (so
        that device memory left for the KV cache is measured after it); returns its bytes."""
        total = 0
        for layer in self.layers:
            if getattr(layer.attn, "recurrent", False):
                layer.attn.reserve(slots, self.embed_tokens)
                total += layer.attn.state_bytes()
        return total

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, H] of the new tokens; their K/V land in ``kv_caches``."""
        step = self.native_step
        if (step is not None and enabled() and use_cpu_kernels(input_ids)
                and step.applies(input_ids, positions, meta)):
            return step(input_ids, positions, kv_caches, meta)
        x = nn.functional.embedding(input_ids, self.embed_tokens)
        residual = None
        rope = Rope(self.cos_sin, positions, self.embed_tokens.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, rope, kv, meta)
        x, _ = rms_norm(x, self.norm, self.spec.rms_norm_eps, residual)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] for selected final hidden states [N, H]. The C LM head first,
        outside inference mode: entering it is one more cold operator per decode step."""
        step = self.native_step
        if step is not None and enabled() and use_cpu_kernels(hidden):
            out = step.logits(hidden)
            if out is not None:
                return out
        with torch.inference_mode():
            return self.lm_head(hidden).float()
