"""Qwen3.5-MoE's token mixers in the engine: the Gated DeltaNet (linear attention with a
per-sequence recurrent state) and the gated full attention.

A Gated DeltaNet layer keeps, for every sequence, a state instead of a KV cache: the last
``kernel - 1`` inputs of its depthwise causal conv, and a [value heads, key dim, value dim] fp32
matrix updated token by token by the gated delta rule (decay ``exp(g)``, write strength
``beta``). The state lives in the sequence's slot, its row of the block tables
(``AttentionMetadata.state_rows``): a sequence that starts at position 0 (a new one, or one
preempted and recomputed) starts from zeros, and each chunk of a chunked prefill and each decode
step continues from the state the previous one left. The recurrence runs token by token in
plain torch (decode's one step; prefill's loop), so a batch of prefill chunks and decode tokens
goes through it one sequence at a time. The paged KV cache holds the full-attention layers only
(``ModelSpec.recurrent_layers`` have empty entries). Prefix caching and speculative decoding cannot skip or
undo tokens of a recurrence: the engine turns the first off and refuses the second for such a
model.

The gated full attention is the engine's attention with ``q_proj`` emitting each head's query
and a gate side by side; the output is multiplied by ``sigmoid(gate)`` before ``o_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from thresher.serve_kernels.kernels import rms_norm
from thresher.serve_kernels.modeling.attention import AttentionMetadata
from thresher.serve_kernels.modeling.decoder import Attention, Rope
from thresher.serve_kernels.modeling.linear import Linear


class GatedDeltaNet(nn.Module):
    """One linear-attention layer over packed new tokens, with per-slot recurrent state."""

    reads_host_lengths = True  # walks the host lengths per sequence: no CUDA graph replay
    recurrent = True

    def __init__(self, in_proj_qkv: Linear, in_proj_z: Linear, in_proj_b: Linear,
                 in_proj_a: Linear, conv_weight: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, norm: torch.Tensor, out_proj: Linear, *, num_k_heads: int,
                 num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float):
        super().__init__()
        self.in_proj_qkv, self.in_proj_z = in_proj_qkv, in_proj_z
        self.in_proj_b, self.in_proj_a, self.out_proj = in_proj_b, in_proj_a, out_proj
        self.register_buffer("conv_weight", conv_weight.reshape(conv_weight.shape[0], -1))
        self.register_buffer("neg_a", -a_log.float().exp())  # -exp(A_log), as the forward has it
        self.register_buffer("dt_bias", dt_bias.float())
        self.register_buffer("norm", norm)
        self.num_k, self.num_v, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.eps = eps
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (conv, delta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        if meta.state_rows is None:
            raise RuntimeError("a Gated DeltaNet layer needs each sequence's state slot "
                               "(AttentionMetadata.state_rows)")
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = self.neg_a * nn.functional.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = torch.empty(x.shape[0], self.num_v, self.dv, dtype=torch.float32, device=x.device)
        start = 0
        for row, n, context in zip(meta.state_rows, meta.query_lens, meta.context_lens_list,
                                   strict=True):
            span = slice(start, start + n)
            conv, delta = self._state(row, fresh=context == n, like=x)
            qkv, conv = self._conv(mixed[span], conv)
            out[span], delta = self._delta_rule(qkv, g[span], beta[span], delta)
            self.states[row] = (conv, delta)
            start += n
        o = rms_norm(out.to(x.dtype), self.norm, self.eps)  # per value head
        o = (o.float() * nn.functional.silu(z.view_as(o).float())).to(x.dtype)
        return self.out_proj(o.reshape(x.shape[0], -1))

    def _state(self, row: int, fresh: bool, like: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if fresh or row not in self.states:
            channels, taps = self.conv_weight.shape
            return (torch.zeros(channels, taps - 1, dtype=like.dtype, device=like.device),
                    torch.zeros(self.num_v, self.dk, self.dv, dtype=torch.float32,
                                device=like.device))
        return self.states[row]

    def _conv(self, mixed: torch.Tensor, conv: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv + SiLU of one sequence's new inputs [n, C] continuing from its
        last inputs ``conv`` [C, kernel - 1]; returns the outputs and the new conv state."""
        taps = self.conv_weight.shape[1]
        seq = torch.cat([conv, mixed.t()], dim=1)  # [C, kernel - 1 + n]
        windows = seq.unfold(1, taps, 1)  # [C, n, kernel]
        y = (windows * self.conv_weight[:, None, :]).sum(-1)
        return nn.functional.silu(y).t(), seq[:, seq.shape[1] - (taps - 1):].contiguous()

    def _delta_rule(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over one sequence's tokens in fp32: per token, decay the state,
        write v's correction against what the state recalls for k, read it with q."""
        n = qkv.shape[0]
        kd = self.num_k * self.dk
        q, k, v = qkv.float().split([kd, kd, self.num_v * self.dv], dim=-1)
        rep = self.num_v // self.num_k
        q = q.view(n, self.num_k, self.dk).repeat_interleave(rep, dim=1)
        k = k.view(n, self.num_k, self.dk).repeat_interleave(rep, dim=1)
        v = v.view(n, self.num_v, self.dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / self.dk ** 0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        out = torch.empty(n, self.num_v, self.dv, dtype=torch.float32, device=qkv.device)
        for t in range(n):
            state = state * g[t].exp()[:, None, None]
            recalled = (state * k[t][:, :, None]).sum(1)
            correction = (v[t] - recalled) * beta[t][:, None]
            state = state + k[t][:, :, None] * correction[:, None, :]
            out[t] = (state * q[t][:, :, None]).sum(1)
        return out, state


class GatedAttention(Attention):
    """Rotary GQA attention whose ``q_proj`` emits each head's query then its output gate
    ([T, heads, 2, D]); the output is multiplied by ``sigmoid(gate)`` before ``o_proj``."""

    _gate: torch.Tensor | None = None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        t, hq, d = x.shape[0], self.num_heads, self.head_dim
        query_gate = qkv[:, : 2 * hq * d].view(t, hq, 2, d)
        self._gate = query_gate[:, :, 1].reshape(t, hq * d)
        return torch.cat([query_gate[:, :, 0].reshape(t, hq * d), qkv[:, 2 * hq * d :]], dim=-1)

    def gate_output(self, o: torch.Tensor) -> torch.Tensor:
        gate, self._gate = self._gate, None
        return o * torch.sigmoid(gate)
