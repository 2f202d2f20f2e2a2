"""gpt-oss's engine modules: attention with sinks over a sliding window, and its biased MoE.

Attention sinks are a learned logit per head that joins the softmax denominator and contributes
no value, so a head can attend to "nothing". Every other gpt-oss layer attends only to its last
``sliding_window`` positions. Both run here in PyTorch over the paged cache, on every device (the
Triton kernels take neither): each sequence's keys are gathered, masked (causal, and the window),
the sink appended as one more logit, and the softmax taken in fp32. The paged cache keeps every
block of a sliding layer (a block that fell out of the window is not freed), so memory per token
is the same as for full layers; vLLM frees them, this engine trades that memory for one cache
layout. The per-sequence host lengths are read, so a model with these layers decodes without
CUDA graphs (``CausalLM.graph_safe``).

The MoE: router logits with a bias, top-k of the logits, softmax over the k; each expert computes
``down((clamp(up x + b_u) + 1) * g * sigmoid(alpha g)) + b_d`` with ``g = min(gate x + b_g,
limit)`` (``models.gpt_oss.clamped_swiglu``), its linears 16-bit or quantized with full-precision
biases.
"""

from __future__ import annotations

import torch
from torch import nn

from thresher.models import mxfp4
from thresher.models.adapters import EXPERT_ROLES
from thresher.models.gpt_oss import clamped_swiglu
from thresher.serve_kernels.modeling.attention import AttentionMetadata, _gather
from thresher.serve_kernels.modeling.decoder import Attention
from thresher.serve_kernels.modeling.linear import DenseLinear, Linear


class SinkAttention(Attention):
    """``Attention`` with a per-head sink logit and, in sliding layers, a window."""

    reads_host_lengths = True

    def __init__(self, *args, sinks: torch.Tensor, window: int | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("sinks", sinks)
        self.window = window

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        return sink_attention(q, k_cache, v_cache, meta, self.scale, self.sinks, self.window)


def sink_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, sinks: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """q [T, Hq, D] of the packed new tokens -> output [T, Hq, D], as transformers' eager
    gpt-oss attention computes it (logits, mask, sink column, fp32 softmax, sink dropped)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for b, q_len in enumerate(meta.query_lens):
        length = meta.context_lens_list[b]
        k, v = _gather(k_cache, v_cache, meta.block_tables[b : b + 1], length)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qb = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        logits = (qb @ k.transpose(-1, -2)).float() * scale  # [1, Hq, q_len, length]
        qpos = torch.arange(length - q_len, length, device=q.device)[:, None]
        kpos = torch.arange(length, device=q.device)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        logits = logits.masked_fill(~allowed, float("-inf"))
        sink = sinks.float().view(1, -1, 1, 1).expand(1, -1, q_len, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        o = probs.to(v.dtype) @ v  # [1, Hq, q_len, D]
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


class GptOssMoE(nn.Module):
    """Biased router, softmax over the top-k logits, experts with biases and a clamped SwiGLU;
    each forward visits only the experts that got tokens."""

    def __init__(self, router: Linear, gate: list[Linear], up: list[Linear], down: list[Linear],
                 top_k: int, alpha: float, limit: float):
        super().__init__()
        self.router = router
        self.gate, self.up, self.down = nn.ModuleList(gate), nn.ModuleList(up), nn.ModuleList(down)
        self.top_k, self.alpha, self.limit = top_k, alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            xe = x[token]
            h = clamped_swiglu(self.gate[e](xe), self.up[e](xe), self.alpha, self.limit)
            out.index_add_(0, token, self.down[e](h) * weights[token, slot, None])
        return out


def build_moe(b, adapter, config, i: int) -> GptOssMoE:
    """Layer ``i``'s MoE from the loader's builder ``b``: experts fused as on the hub (16-bit
    checkpoints), or per expert with their biases (quantized ones)."""
    count = adapter.layer_num_experts(config, i)
    prefix = f"{adapter.disk_layer_prefix(i)}mlp.experts."
    fused = {name: _fused(b, prefix + name) for name in ("gate_up_proj", "gate_up_proj_bias",
                                                          "down_proj", "down_proj_bias")}
    if all(t is not None for t in fused.values()):
        gate_up, gate_up_bias = fused["gate_up_proj"], fused["gate_up_proj_bias"]
        down, down_bias = fused["down_proj"], fused["down_proj_bias"]
        roles = {"gate": [DenseLinear(gate_up[e][:, 0::2].t().contiguous(), gate_up_bias[e][0::2])
                          for e in range(count)],
                 "up": [DenseLinear(gate_up[e][:, 1::2].t().contiguous(), gate_up_bias[e][1::2])
                        for e in range(count)],
                 "down": [DenseLinear(down[e].t().contiguous(), down_bias[e])
                          for e in range(count)]}
    else:
        roles = {r: [b.linear(adapter.disk_expert_key(i, e, r)) for e in range(count)]
                 for r in EXPERT_ROLES}
    return GptOssMoE(b.linear(adapter.disk_router_key(i)), roles["gate"], roles["up"],
                     roles["down"], adapter.top_k(config), float(config.swiglu_alpha),
                     float(config.swiglu_limit))


def _fused(b, key: str) -> torch.Tensor | None:
    """A fused expert tensor as on the hub, its MXFP4 blocks dequantized; None if absent."""
    if key in b.reader:
        return b.tensor(key)
    if key + mxfp4.BLOCKS_SUFFIX not in b.reader:
        return None
    t = mxfp4.dequantize(b.reader.get(key + mxfp4.BLOCKS_SUFFIX),
                         b.reader.get(key + mxfp4.SCALES_SUFFIX), b.dtype, f"{b.reader.path}: {key}")
    b.params += t.numel()
    return t
