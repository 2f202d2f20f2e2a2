"""The CPU decode step as one native call (``kernels/cpu_step.c``) instead of operator dispatch.

Why: on the operator path a decode step is Python and torch dispatch around thresher's C
kernels: per layer a dozen operators (norms, q/k/v, rotary, cache store, attention, o-proj,
router, top-k, experts, residuals), a few microseconds to tens of microseconds each. That host
time is fixed, so where memory is fast it dominates (measured on a 2-core Xeon with 32.6 GB/s
copy bandwidth: the GPTQ-4 step read its weights at 40% of the bandwidth, llama.cpp's at 76%).
A ctypes call costs about 5 us with its arguments (measured: 0.2 us bare, 5.7 us for a 7-argument
call with three ``data_ptr()``). A compiled graph was the other way: torch.compile cannot take
the engine's operator path whole (its C kernels are ctypes calls, graph breaks), and on
transformers' own forward of the same 1.08 GB MoE (static cache, Inductor's CPU backend) it
decoded at 0.45x (two threads) and 0.63x (one) this step's rate, 1.2-1.3x transformers eager
(``benchmarks/engine/compiled_decode.py``). So the model's layers are described
once, as a table of pointers to the weights in the layouts the engine already holds (cpu_q4's
packs, 16-bit / fp32 row-major matrices, fp32 norms and biases), and one call per step runs
every layer with OpenMP threads inside the matmuls and the attention.

The step covers standard rotary attention (partial and interleaved rotary, q/k norms, clipping,
biases) and multi-head latent attention with kv_b absorbed as ``mla.py`` runs it (DeepSeek-V3,
Kimi-K2); softmax routing and the routing rules with sigmoid scores, a selection bias and expert
groups (GLM-4.5, DeepSeek-V3, ERNIE-4.5); gpt-oss's attention sinks and sliding windows, and its
experts (biases, top-k logits softmaxed, the clamped SwiGLU); Qwen3.5's gated attention and Gated
DeltaNet (its conv and delta-rule states updated in place, token by token). ``build`` returns
None (the operator path stays) for what it does not cover: torch-kernel int4 and int8 packs,
act-order GPTQ whose q/k/v stay apart, fp16. NF4 runs on thresher's own kernel (``cpu_nf4.c``,
from the published codes; bf16 activations, as bitsandbytes' kernel on the operator path). 16-bit
matrices held in oneDNN's blocked layout are turned back into row-major ones (the C step reads
those; prefill's matmuls then run row-major, about level at prefill's row counts).
``CausalLM.forward`` calls the step for CPU batches of decode tokens only;
``THRESHER_CPU_STEP=off`` keeps the operator path (read per step; at load it also keeps the
blocked layout).

Measured (docs/benchmarks.md, "CPU decode against llama.cpp"): on the 1.08 GB Qwen3-MoE, at one
sequence, 1.7-2.1x the operator path's decode rate for GPTQ-4, 1.4-1.7x for bf16 and 2.1-2.5x
for NF4 (one and two threads; bf16 1.3-1.5x at 16 sequences, on the AMX tiles), with 0.4-0.7 ms
of host time per step left (scheduling, metadata, sampling).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import torch
from torch import nn

from thresher.serve_kernels.kernels.cpu_blocked import unblock
from thresher.serve_kernels.kernels.cpu_int4 import Int4Pack
from thresher.serve_kernels.kernels.cpu_int8 import Q8Pack
from thresher.serve_kernels.kernels.cpu_native import loaded
from thresher.serve_kernels.kernels.cpu_step import (
    LIN_BF16,
    LIN_F32,
    LIN_NF4,
    LIN_NONE,
    LIN_Q4,
    LIN_Q8,
    ThrLayer,
    ThrLinear,
    ThrModel,
)
from thresher.serve_kernels.modeling.attention import AttentionMetadata
from thresher.serve_kernels.modeling.linear import (
    AWQLinear,
    ConcatLinear,
    DenseLinear,
    GPTQLinear,
    NF4Linear,
)

log = logging.getLogger(__name__)

ENV = "THRESHER_CPU_STEP"  # "off": decode steps keep the operator path
DTYPES = {torch.float32: LIN_F32, torch.bfloat16: LIN_BF16}


def enabled() -> bool:
    """False when ``THRESHER_CPU_STEP=off`` (read per step, so a running engine can be switched)."""
    return os.environ.get(ENV, "").strip().lower() != "off"


class Unsupported(Exception):
    """A part of the model the C step does not run (the message says which)."""


class _Keep:
    """Tensors the C table points into, kept alive beside it."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        if not t.is_contiguous():
            t = t.contiguous()
        self.tensors.append(t)
        return t.data_ptr()

    def f32(self, t: torch.Tensor | None) -> int | None:
        return None if t is None else self.ptr(t.detach().float().contiguous())


def _dense(w: torch.Tensor, bias: torch.Tensor | None, keep: _Keep) -> ThrLinear:
    if w.dtype not in DTYPES or w.dim() != 2:
        raise Unsupported(f"a {w.dtype} matrix")
    return ThrLinear(DTYPES[w.dtype], 0, w.shape[0], w.shape[1], 0, keep.ptr(w), None,
                     keep.f32(bias))


def _q4(pack: Int4Pack, bias: torch.Tensor | None, keep: _Keep) -> ThrLinear:
    if pack.kernel != "q4" or pack.perm is not None:
        raise Unsupported("an int4 pack on torch's kernel or with act-order")
    return ThrLinear(LIN_Q4, 0, pack.out_features, pack.weight.shape[1] * 2, pack.group_size,
                     keep.ptr(pack.weight), keep.ptr(pack.scales_zeros), keep.f32(bias))


def _q8(pack: Q8Pack, bias: torch.Tensor | None, keep: _Keep) -> ThrLinear:
    return ThrLinear(LIN_Q8, 0, pack.out_features, pack.weight.shape[1], pack.group_size,
                     keep.ptr(pack.weight), keep.ptr(pack.scales_zeros), keep.f32(bias))


def _nf4(m: NF4Linear, keep: _Keep) -> ThrLinear:
    """An NF4 weight on cpu_nf4.c: the published codes, the absmax in bf16 per output row."""
    w = m.nf4
    n, k = w.shape
    if w.blocksize % 32 or k % w.blocksize:
        raise Unsupported(f"NF4 blocks of {w.blocksize} over rows of {k}")
    absmax = w.absmax_fp32().float().to(torch.bfloat16).reshape(n, k // w.blocksize)
    return ThrLinear(LIN_NF4, 0, n, k, w.blocksize, keep.ptr(w.packed.reshape(-1)),
                     keep.ptr(absmax), keep.f32(m.bias), keep.f32(w.quant_map))


def linear(m: nn.Module, keep: _Keep) -> ThrLinear:
    """The C view of one of the engine's linears, as its CPU forward computes it."""
    if isinstance(m, DenseLinear):
        if m.cpu_fp32 is not None:  # a narrow matrix (router) multiplied in fp32
            return _dense(m.cpu_fp32[0], m.cpu_fp32[1], keep)
        if m.cpu_blocked is not None:  # the C step reads row-major weights
            m.weight, m.cpu_blocked = unblock(m.cpu_blocked), None
        return _dense(m.weight, m.bias, keep)
    if isinstance(m, ConcatLinear) and m.cpu_dense is not None:
        return _dense(m.cpu_dense, m.cpu_bias, keep)
    if isinstance(m, GPTQLinear | AWQLinear | NF4Linear) and m.cpu_dense is not None:
        return _dense(m.cpu_dense, m.bias, keep)  # a small matrix dequantized at load
    if isinstance(m, GPTQLinear | AWQLinear) and isinstance(m.cpu_pack, Int4Pack):
        return _q4(m.cpu_pack, m.bias, keep)
    if isinstance(m, GPTQLinear) and isinstance(m.cpu_pack, Q8Pack):
        return _q8(m.cpu_pack, m.bias, keep)
    if isinstance(m, NF4Linear):
        return _nf4(m, keep)
    raise Unsupported(f"{type(m).__name__} without a dense copy or a cpu_q4 pack")


def _experts(experts: nn.Module, keep: _Keep, out: ThrLayer, arrays: list
             ) -> tuple[ctypes.Array, ctypes.Array, int]:
    """(gate_up, down) arrays of one ThrLinear per expert, and whether they compute in bf16; NF4
    and 8-bit experts keep gate and up apart (``out.up``)."""
    from thresher.serve_kernels.modeling.moe import ExpertLoop, FusedExperts

    if not isinstance(experts, FusedExperts | ExpertLoop):
        raise Unsupported(type(experts).__name__)
    if experts.cpu_dense is not None:  # small quantized experts dequantized at load
        gu = [_dense(w, None, keep) for w in experts.cpu_dense[0]]
        dn = [_dense(w, None, keep) for w in experts.cpu_dense[1]]
        bf16 = 0
    elif isinstance(experts, ExpertLoop):
        linears = (*experts.gate, *experts.up, *experts.down)
        nf4 = all(isinstance(m, NF4Linear) for m in linears)
        if not nf4 and not all(isinstance(getattr(m, "cpu_pack", None), Q8Pack) for m in linears):
            raise Unsupported("experts kept as separate linears, neither NF4 nor cpu_q4's 8-bit")
        gu, up, dn = ([_nf4(m, keep) if nf4 else _q8(m.cpu_pack, m.bias, keep) for m in mods]
                      for mods in (experts.gate, experts.up, experts.down))
        out.up = (ThrLinear * len(up))(*up)
        arrays.append(out.up)
        bf16 = int(nf4)  # bitsandbytes' kernel: bf16 activations in, bf16 out
    elif experts.cpu_q4 is not None:
        gu = [_q4(p, None, keep) for p in experts.cpu_gate_up]
        dn = [_q4(p, None, keep) for p in experts.cpu_down]
        bf16 = 1  # cpu_q4's expert path rounds its activations to bf16
    elif experts.format == "dense":
        experts.row_major()
        gu = [_dense(w, None, keep) for w in experts.gate_up_weight]
        dn = [_dense(w, None, keep) for w in experts.down_weight]
        bf16 = 0
    else:
        raise Unsupported(f"{experts.format} experts without cpu_q4 packs")
    return (ThrLinear * len(gu))(*gu), (ThrLinear * len(dn))(*dn), bf16


def _attention(attn: nn.Module, out: ThrLayer, keep: _Keep, dtype: torch.dtype) -> None:
    """Fill ``out``'s token mixer: rotary GQA (plain, with sinks, or gated), latent attention
    (MLA, kv_b absorbed) or a Gated DeltaNet."""
    from thresher.serve_kernels.modeling.decoder import Attention
    from thresher.serve_kernels.modeling.deltanet import GatedAttention, GatedDeltaNet
    from thresher.serve_kernels.modeling.gpt_oss import SinkAttention
    from thresher.serve_kernels.modeling.mla import LatentAttention

    if type(attn) is LatentAttention:
        if attn.rope_dim % 2:
            raise Unsupported("latent attention with an odd rotary width")
        out.mla, out.qkv, out.q_b = 1, linear(attn.down, keep), linear(attn.q_proj, keep)
        out.o = linear(attn.o_proj, keep)
        out.heads, out.q_rank, out.nope, out.rank = (attn.num_heads, attn.q_rank, attn.nope,
                                                     attn.rank)
        out.v_dim, out.rotary_dim, out.att_scale = attn.v_dim, attn.rope_dim, attn.scale
        out.interleave = int(attn.interleaved)
        out.q_a_norm, out.kv_a_norm = keep.f32(attn.q_a_norm), keep.f32(attn.kv_a_norm)
        # W_kb^T per head [H, rank, nope]: the query's absorption is then x @ W.T like any linear
        out.w_kb_t = keep.ptr(attn.w_kb.transpose(1, 2).to(dtype).contiguous())
        out.w_vb = keep.ptr(attn.w_vb.to(dtype).contiguous())
        return
    if type(attn) is GatedDeltaNet:
        _delta_net(attn, out, keep, dtype)
        return
    if type(attn) not in (Attention, SinkAttention, GatedAttention) or attn.rotary_dim % 2:
        raise Unsupported(f"attention {type(attn).__name__}")
    out.gated = int(type(attn) is GatedAttention)
    if type(attn) is SinkAttention:
        out.sinks, out.window = keep.f32(attn.sinks), attn.window or 0
    out.qkv, out.o = linear(attn.qkv, keep), linear(attn.o_proj, keep)
    out.rotary_dim = attn.rotary_dim
    out.clip, out.interleave = float(attn.clip_qkv or 0.0), int(attn.interleaved_rotary)
    if attn.q_norm is not None:
        out.q_norm, out.k_norm = keep.f32(attn.q_norm), keep.f32(attn.k_norm)
        out.qk_norm_full = int(not attn.per_head_norm)


def _delta_net(mixer: nn.Module, out: ThrLayer, keep: _Keep, dtype: torch.dtype) -> None:
    """Fill ``out``'s Gated DeltaNet; its state pointers are set per step (``NativeStep``)."""
    out.delta, out.qkv, out.o = 1, linear(mixer.in_proj_qkv, keep), linear(mixer.out_proj, keep)
    out.in_z, out.in_b = linear(mixer.in_proj_z, keep), linear(mixer.in_proj_b, keep)
    out.in_a = linear(mixer.in_proj_a, keep)
    out.nk, out.nv, out.dk, out.dv = mixer.num_k, mixer.num_v, mixer.dk, mixer.dv
    out.taps, out.delta_eps = mixer.conv_weight.shape[1], mixer.eps
    out.conv_w = keep.ptr(mixer.conv_weight.to(dtype).contiguous())
    out.neg_a, out.dt_bias = keep.f32(mixer.neg_a), keep.f32(mixer.dt_bias)
    out.delta_norm = keep.f32(mixer.norm)


def _rule(mlp: nn.Module, out: ThrLayer, keep: _Keep) -> None:
    """Fill ``out``'s routing rule (sigmoid scores, a selection bias, groups) where it has one."""
    rule = mlp.rule
    if rule is None:
        return
    if rule.scoring not in ("softmax", "sigmoid"):
        raise Unsupported(f"{rule.scoring} routing")
    groups = rule.n_group if rule.scoring == "sigmoid" else 1
    if groups > 1 and (out.experts % groups or rule.top_k > rule.topk_group * out.experts
                       // groups):
        raise Unsupported("expert groups that do not divide the experts or hold the top-k")
    out.rule, out.sigmoid = 1, int(rule.scoring == "sigmoid")
    out.n_group, out.topk_group, out.scaling = groups, rule.topk_group, float(rule.scaling)
    out.renorm = int(rule.renormalize)
    out.correction = keep.f32(mlp.correction)


def _gpt_oss(mlp: nn.Module, out: ThrLayer, keep: _Keep, arrays: list
             ) -> tuple[ctypes.Array, ctypes.Array]:
    """Fill ``out``'s gpt-oss MoE: biased router, softmax over the top-k logits, experts as
    separate gate / up / down linears with biases and the clamped SwiGLU."""
    gate, up, down = ([linear(m, keep) for m in mods] for mods in (mlp.gate, mlp.up, mlp.down))
    ups = (ThrLinear * len(up))(*up)
    arrays.append(ups)
    out.moe, out.top_k, out.experts, out.router = 1, mlp.top_k, len(gate), linear(mlp.router, keep)
    out.topk_softmax, out.clamped, out.alpha, out.limit = 1, 1, mlp.alpha, mlp.limit
    out.up = ups
    return (ThrLinear * len(gate))(*gate), (ThrLinear * len(down))(*down)


def _layer(layer: nn.Module, keep: _Keep, arrays: list, dtype: torch.dtype) -> ThrLayer:
    from thresher.serve_kernels.modeling.decoder import DenseMLP
    from thresher.serve_kernels.modeling.gpt_oss import GptOssMoE
    from thresher.serve_kernels.modeling.moe import MoE

    attn, mlp = layer.attn, layer.mlp
    out = ThrLayer(in_norm=keep.f32(layer.input_norm),
                   post_norm=keep.f32(layer.post_attention_norm))
    _attention(attn, out, keep, dtype)
    if isinstance(mlp, DenseMLP):
        gu, dn = (ThrLinear * 1)(linear(mlp.gate_up, keep)), (ThrLinear * 1)(linear(mlp.down_proj,
                                                                                    keep))
        out.moe = 0
    elif type(mlp) is GptOssMoE:
        gu, dn = _gpt_oss(mlp, out, keep, arrays)
    elif type(mlp) is MoE:
        gu, dn, out.expert_bf16 = _experts(mlp.experts, keep, out, arrays)
        out.moe, out.top_k, out.experts, out.renorm = 1, mlp.top_k, len(gu), int(mlp.renormalize)
        out.router = linear(mlp.router, keep)
        _rule(mlp, out, keep)
        if mlp.shared_expert is not None:
            out.shared_gate_up = linear(mlp.shared_expert.gate_up, keep)
            out.shared_down = linear(mlp.shared_expert.down_proj, keep)
            if mlp.shared_gate is not None:
                out.shared_gate = linear(mlp.shared_gate, keep)
    else:
        raise Unsupported(f"MLP {type(mlp).__name__}")
    arrays += [gu, dn]
    out.gate_up, out.down = gu, dn
    return out


def _widths(layers: ctypes.Array, spec) -> tuple[int, int]:
    """The widest q|k|v (or latent down) projection and the widest per-token attention buffer
    (queries, outputs, latent queries and cache rows, the query's low rank) of any layer."""
    qkv, att = [1], [spec.num_heads * spec.head_dim]
    for L in layers:
        qkv.append(L.qkv.n)
        if L.delta:  # the output and z per value head; normed q and k (in the expert rows)
            att += [L.nv * L.dv, 2 * L.nk * L.dk]
            if 2 * L.nv > spec.hidden_size:
                raise Unsupported("a Gated DeltaNet with more than hidden / 2 value heads")
        if L.mla:
            att += [L.q_b.n, L.heads * (L.rank + L.rotary_dim), L.heads * L.v_dim, L.q_rank]
    return max(qkv), max(att)


def _max_inter(layers: ctypes.Array) -> int:
    """The widest intermediate size of any MLP (sizes the step's scratch buffers)."""
    widths = [1]
    for L in layers:
        n = L.experts if L.moe else 1
        widths += [L.gate_up[e].n // (1 if L.up else 2) for e in range(n)]
        if L.shared_gate_up.kind != LIN_NONE:
            widths.append(L.shared_gate_up.n // 2)
    return max(widths)


class NativeStep:
    """One model's table for ``thr_decode_step``, and the call for a decode batch."""

    def __init__(self, model: nn.Module):
        spec = model.spec
        dtype = model.embed_tokens.dtype
        if dtype not in DTYPES:
            raise Unsupported(f"serving dtype {dtype}")
        self._keep, self._arrays = _Keep(), []
        layers = [_layer(layer, self._keep, self._arrays, dtype) for layer in model.layers]
        # Gated DeltaNet layers (their C table entry, their module): states bound per step
        self._recurrent = [(i, layer.attn) for i, (layer, L) in enumerate(
            zip(model.layers, layers, strict=True)) if L.delta]
        self._like = model.embed_tokens
        self.layers = (ThrLayer * len(layers))(*layers)
        self.dtype, self.hidden = dtype, spec.hidden_size
        qkv_max, att_max = _widths(self.layers, spec)
        self.table = ThrModel(
            layers=len(layers), hidden=spec.hidden_size, hq=spec.num_heads,
            hkv=spec.num_kv_heads, d=spec.head_dim, block_size=0, max_inter=_max_inter(self.layers),
            qkv_max=qkv_max, att_max=att_max,
            eps=spec.rms_norm_eps, scale=spec.head_dim ** -0.5, bf16=int(dtype == torch.bfloat16),
            embed=self._keep.ptr(model.embed_tokens), final_norm=self._keep.f32(model.norm),
            cos_sin=self._keep.ptr(model.cos_sin.float()), layer=self.layers)
        try:
            self.table.lm_head = linear(model.lm_head, self._keep)
        except Unsupported as e:
            log.info("the LM head stays on torch: the C step does not run %s", e)
        self.vocab = self.table.lm_head.n
        self._table_ref = ctypes.byref(self.table)
        self._bound: int | None = None
        self.calls, self.seconds = 0, 0.0  # steps run; time inside the C calls (LM head too)

    def _bind(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Point each layer at its cache (the runner allocates them after the model loads); a
        latent cache is one tensor, the keys' and the values' rows at once; a recurrent layer's
        entry is empty."""
        for L, cache in zip(self.layers, kv_caches, strict=True):
            k, v = cache if len(cache) == 2 else (cache[0], cache[0])
            if k.dtype != self.dtype or not (k.is_contiguous() and v.is_contiguous()):
                raise Unsupported("a KV cache in another dtype or layout")
            L.k_cache, L.v_cache = k.data_ptr(), v.data_ptr()
        self.table.block_size = next(c[0].shape[1] for c in kv_caches if c[0].dim() > 1)
        self._bound = kv_caches[0][0].data_ptr()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, ...]], meta: AttentionMetadata
                 ) -> torch.Tensor:
        """Final hidden states [T, H] of T decode tokens (one per sequence)."""
        if kv_caches[0][0].data_ptr() != self._bound:
            self._bind(kv_caches)
        tables, slots, ctx = meta.block_tables, meta.slot_mapping, meta.context_lens
        if slots.dtype != torch.long:
            slots = slots.long()
        ids = input_ids if input_ids.is_contiguous() else input_ids.contiguous()
        rows = self._bind_states(meta) if self._recurrent else None
        return self._step(ids.shape[0], ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                          tables.data_ptr(), tables.stride(0), ctx.data_ptr(),
                          None if rows is None else rows.data_ptr())

    def _step(self, t: int, ids: int, positions: int, slots: int, tables: int, stride: int,
              ctx: int, rows: int | None) -> torch.Tensor:
        """``thr_decode_step`` on t tokens' inputs at these addresses: hidden states [t, H]."""
        out = torch.empty(t, self.hidden, dtype=self.dtype)
        start = time.perf_counter()
        rc = loaded().thr_decode_step(self._table_ref, t, ids, positions, slots, tables, stride,
                                      ctx, rows, out.data_ptr())
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if rc:
            raise MemoryError("cpu_step: out of memory for the step's buffers")
        return out

    def decode_lists(self, ids: list[int], positions: list[int], slots: list[int],
                     context_lens: list[int], tables: tuple[int, int],
                     kv_caches: list[tuple[torch.Tensor, ...]], state_rows: list[int]
                     ) -> torch.Tensor:
        """``__call__`` from the runner's host lists, with no tensor built for them: ``tables``
        is (address of the first token's block-table row, row stride in entries), rows the
        ``BlockTables`` tensor already holds (``BlockTables.host_rows``). After a step has
        streamed the weights through the caches, each torch operator on the host path runs
        cold (30-40 us where it takes 3 warm); ctypes arrays of the lists take a few."""
        if kv_caches[0][0].data_ptr() != self._bound:
            self._bind(kv_caches)
        t = len(ids)
        ints = (ctypes.c_int64 * (3 * t))(*ids, *positions, *slots)
        ctx = (ctypes.c_int32 * t)(*context_lens)
        rows = None
        if self._recurrent:
            rows = (ctypes.c_int64 * t)(*self._reserve_states(state_rows, context_lens))
        base = ctypes.addressof(ints)
        return self._step(t, base, base + 8 * t, base + 16 * t, tables[0], tables[1],
                          ctypes.addressof(ctx), None if rows is None else ctypes.addressof(rows))

    def _bind_states(self, meta: AttentionMetadata) -> torch.Tensor:
        """The batch's state slots [T] (``_reserve_states``) as a tensor."""
        if meta.state_rows is None:
            raise RuntimeError("a Gated DeltaNet layer needs each sequence's state slot "
                               "(AttentionMetadata.state_rows)")
        return torch.tensor(self._reserve_states(meta.state_rows, meta.context_lens_list),
                            dtype=torch.long)

    def _reserve_states(self, rows: list[int], context_lens: list[int]) -> list[int]:
        """The batch's state slots ``rows``; each Gated DeltaNet's states grown to hold them,
        zeroed for a sequence at its first token, and pointed at (``reserve`` may move them)."""
        fresh = [r for r, c in zip(rows, context_lens, strict=True) if c == 1]
        for i, mixer in self._recurrent:
            mixer.reserve(max(rows) + 1, self._like)
            if fresh:
                mixer.conv_state[fresh] = 0
                mixer.delta_state[fresh] = 0
            L = self.layers[i]
            L.conv_state, L.delta_state = (mixer.conv_state.data_ptr(),
                                           mixer.delta_state.data_ptr())
        return rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits [N, V] of final hidden states [N, H] through the C LM head (None where it
        stays on torch, or for a tensor it does not read)."""
        if (self.table.lm_head.kind == LIN_NONE or hidden.dtype != self.dtype or hidden.is_cuda
                or not hidden.is_contiguous()):
            return None
        out = torch.empty(hidden.shape[0], self.vocab)
        start = time.perf_counter()
        rc = loaded().thr_lm_head(self._table_ref, hidden.data_ptr(), hidden.shape[0],
                                  out.data_ptr())
        self.seconds += time.perf_counter() - start
        if rc:
            raise MemoryError("cpu_step: out of memory for the LM head's input")
        return out

    def applies(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> bool:
        """Whether this batch is one the C step runs: CPU decode tokens only, exact host lists."""
        return (meta.num_decodes > 0 and meta.all_decode and meta.host_exact
                and not input_ids.is_cuda and input_ids.dtype == torch.long
                and positions.dtype == torch.long and positions.is_contiguous()
                and meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
                and meta.context_lens.dtype == torch.int32 and meta.context_lens.is_contiguous()
                and meta.slot_mapping.is_contiguous())


def build(model: nn.Module) -> NativeStep | None:
    """The C step for a CPU model, or None (the reason logged) where it does not apply."""
    if loaded() is None or not enabled():
        return None
    try:
        return NativeStep(model)
    except Unsupported as e:
        log.info("decode steps keep the operator path: the C step does not run %s", e)
        return None
