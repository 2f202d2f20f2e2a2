"""Qwen3.5-MoE's token mixers in the engine: the Gated DeltaNet (linear attention with a
per-sequence recurrent state) and the gated full attention.

A Gated DeltaNet layer keeps, for every sequence, a state instead of a KV cache: the last
``kernel - 1`` inputs of its depthwise causal conv, and a [value heads, key dim, value dim] fp32
matrix updated token by token by the gated delta rule (decay ``exp(g)``, write strength
``beta``). The state lives in the sequence's slot, its row of the block tables
(``AttentionMetadata.state_rows``): a sequence that starts at position 0 (a new one, or one
preempted and recomputed) starts from zeros, and each chunk of a chunked prefill and each decode
step continues from the state the previous one left. The recurrence runs token by token in
plain torch: a batch's decode tokens take their step together (their states gathered from their
slots and written back), each prefill chunk loops over its tokens. The paged KV cache holds the full-attention layers only
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
        # per slot (block-table row): the conv's last inputs and the delta-rule state, grown
        # to the highest slot seen
        self.conv_state = torch.empty(0, self.conv_weight.shape[0], self.conv_weight.shape[1] - 1)
        self.delta_state = torch.empty(0, num_v_heads, head_k_dim, head_v_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        if meta.state_rows is None:
            raise RuntimeError("a Gated DeltaNet layer needs each sequence's state slot "
                               "(AttentionMetadata.state_rows)")
        self.reserve(max(meta.state_rows) + 1, x)
        fresh = [row for row, n, ctx in zip(meta.state_rows, meta.query_lens,
                                            meta.context_lens_list, strict=True) if ctx == n]
        if fresh:  # a sequence at position 0 (new, or recomputed after preemption)
            self.conv_state[fresh] = 0
            self.delta_state[fresh] = 0
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = self.neg_a * nn.functional.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = torch.empty(x.shape[0], self.num_v, self.dv, dtype=torch.float32, device=x.device)
        nd = meta.num_decodes  # the batch's first sequences, one token each: one step together
        if nd:
            self._run(meta.state_rows[:nd], mixed[:nd, None], g[:nd, None], beta[:nd, None],
                      out[:nd, None])
        start = nd
        for row, n in zip(meta.state_rows[nd:], meta.query_lens[nd:], strict=True):
            span = slice(start, start + n)
            self._run([row], mixed[None, span], g[None, span], beta[None, span], out[None, span])
            start += n
        o = rms_norm(out.to(x.dtype), self.norm, self.eps)  # per value head
        o = (o.float() * nn.functional.silu(z.view_as(o).float())).to(x.dtype)
        return self.out_proj(o.reshape(x.shape[0], -1))

    def reserve(self, rows: int, like: torch.Tensor) -> None:
        """Room for slots 0 .. rows - 1 (new slots zeroed; existing states kept)."""
        have = self.conv_state.shape[0]
        if have >= rows and self.conv_state.device == like.device:
            return
        conv = torch.zeros(max(rows, have), *self.conv_state.shape[1:], dtype=like.dtype,
                           device=like.device)
        delta = torch.zeros(max(rows, have), *self.delta_state.shape[1:], dtype=torch.float32,
                            device=like.device)
        conv[:have] = self.conv_state.to(conv)
        delta[:have] = self.delta_state.to(delta)
        self.conv_state, self.delta_state = conv, delta

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.delta_state))

    def _run(self, rows: list[int], mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             out: torch.Tensor) -> None:
        """Sequences ``rows`` with n new tokens each (mixed [B, n, C], g and beta [B, n, Hv]):
        outputs into ``out`` [B, n, Hv, Dv], states updated in their slots."""
        qkv, conv = self._conv(mixed, self.conv_state[rows])
        out[:], delta = self._delta_rule(qkv, g, beta, self.delta_state[rows])
        self.conv_state[rows] = conv
        self.delta_state[rows] = delta

    def _conv(self, mixed: torch.Tensor, conv: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv + SiLU of new inputs [B, n, C] continuing from each sequence's
        last inputs ``conv`` [B, C, kernel - 1]; returns the outputs and the new conv state."""
        taps = self.conv_weight.shape[1]
        seq = torch.cat([conv, mixed.transpose(1, 2).to(conv.dtype)], dim=2)  # [B, C, k-1+n]
        windows = seq.unfold(2, taps, 1)  # [B, C, n, kernel]
        y = (windows * self.conv_weight[:, None, :]).sum(-1)
        return nn.functional.silu(y).transpose(1, 2), seq[:, :, seq.shape[2] - (taps - 1):]

    def _delta_rule(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over [B, n] tokens in fp32 from states [B, Hv, Dk, Dv]: per
        token, decay the state, write v's correction against what the state recalls for k, read
        it with q."""
        b, n = qkv.shape[:2]
        kd = self.num_k * self.dk
        q, k, v = qkv.float().split([kd, kd, self.num_v * self.dv], dim=-1)
        rep = self.num_v // self.num_k
        q = q.view(b, n, self.num_k, self.dk).repeat_interleave(rep, dim=2)
        k = k.view(b, n, self.num_k, self.dk).repeat_interleave(rep, dim=2)
        v = v.view(b, n, self.num_v, self.dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / self.dk ** 0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        out = torch.empty(b, n, self.num_v, self.dv, dtype=torch.float32, device=qkv.device)
        for t in range(n):
            state = state * g[:, t].exp()[..., None, None]
            recalled = (state * k[:, t, :, :, None]).sum(2)
            correction = (v[:, t] - recalled) * beta[:, t, :, None]
            state = state + k[:, t, :, :, None] * correction[:, :, None, :]
            out[:, t] = (state * q[:, t, :, :, None]).sum(2)
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
