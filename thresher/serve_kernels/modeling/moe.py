"""The mixture-of-experts MLP: router, routed experts, optional shared expert.

Routed experts are stacked along a leading expert dim in their published layout (16-bit, GPTQ
4-bit or AWQ), gate and up concatenated along the output dim, so ``fused_moe`` runs every expert
of a projection in one launch. The stacking moves packed words, never dequantizes them. Layouts
the fused kernel does not read (GPTQ at other widths, act-order g_idx that differs between gate
and up) keep one linear per expert; on a CPU they loop over the experts that received tokens, on
a GPU over every expert (no host read of the routing, see ``ExpertLoop``). NF4 experts keep one
linear each too (the CPU kernels read them so), and on a GPU are stacked for ``fused_moe`` on
their first forward (``stack_nf4``), the linears then reading views of the stacked bytes.

On a CPU, ``pack_for_cpu`` converts each GPTQ-4/AWQ-4 expert once for torch's CPU int4 kernel
(``kernels.cpu_int4``), and each NF4 expert (gate and up as one matrix) for bitsandbytes' CPU NF4
kernel (``kernels.cpu_nf4``, AVX512-BF16 CPUs); ``grouped_moe_packed`` then runs that kernel for
the experts that got tokens instead of dequantizing their matrices on every step. Experts small
enough that a dense matmul beats those kernels (``kernels.cpu_dense``; every expert of the demo
models) are instead dequantized once into the serving dtype and run the 16-bit experts' path
(``grouped_moe_torch``), whatever their layout. Large 16-bit experts are reordered into oneDNN's
blocked layout (``kernels.cpu_blocked``) and run through ``grouped_moe_packed`` like the packed
ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from thresher.formats.awq import AWQ
from thresher.formats.gptq import GPTQ
from thresher.formats.nf4 import NF4, concat_rows
from thresher.formats.registry import format_for
from thresher.models.adapters import RoutingRule
from thresher.serve_kernels.kernels import ExpertWeights, fused_moe, silu_and_mul
from thresher.serve_kernels.kernels.backend import use_cpu_kernels, use_triton
from thresher.serve_kernels.kernels.cpu_blocked import (
    BlockedWeight,
    block,
    blocked_matmul,
    serve_blocked,
    unblock,
)
from thresher.serve_kernels.kernels.cpu_dense import serve_dense
from thresher.serve_kernels.kernels.cpu_int4 import (
    Q4_DTYPES,
    Int4Pack,
    int4_matmul,
    pack_checkpoint_int4,
)
from thresher.serve_kernels.kernels.cpu_nf4 import NF4Pack, nf4_cpu_matmul, pack_nf4_cpu
from thresher.serve_kernels.kernels.cpu_q4 import ExpertTable
from thresher.serve_kernels.modeling.linear import (
    AWQLinear,
    DenseLinear,
    GPTQLinear,
    Linear,
    NF4Linear,
)


class FusedExperts(nn.Module):
    """All experts of a layer as two stacked projections for ``fused_moe``."""

    def __init__(self, fmt: str, gate_up: dict[str, torch.Tensor], down: dict[str, torch.Tensor],
                 group_size: int = -1, contiguous_groups: dict[str, int | None] | None = None):
        super().__init__()
        self.format, self.group_size = fmt, group_size
        # GPTQ without act-order: each projection's group size (``ExpertWeights.contiguous_group``)
        self.contiguous_groups = contiguous_groups or {}
        self._names = sorted(gate_up)
        for name in self._names:
            self.register_buffer(f"gate_up_{name}", gate_up[name])
            self.register_buffer(f"down_{name}", down[name])
        # per expert, the weights a CPU kernel reads: int4 packs, or 16-bit blocked weights
        self.cpu_gate_up: list[Int4Pack] | list[BlockedWeight] | None = None
        self.cpu_down: list[Int4Pack] | list[BlockedWeight] | None = None
        self.cpu_matmul: Callable = int4_matmul
        self.cpu_compute_dtype = torch.bfloat16  # what the kernel multiplies in
        self.cpu_dense: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cpu_q4: ExpertTable | None = None  # one C call per decode token (q4 packs)

    @property
    def cpu_packs(self) -> list[Int4Pack] | list[BlockedWeight]:
        return [*(self.cpu_gate_up or ()), *(self.cpu_down or ())]

    def pack_for_cpu(self, dtype: torch.dtype = torch.float32) -> None:
        """16-bit experts: large ones into oneDNN's blocked layout (``kernels.cpu_blocked``; the
        stacked buffers are released). Quantized: small experts dequantized into ``dtype``
        (``cpu_dense``), else every expert converted for the CPU int4 kernel, or none if any
        expert cannot be held."""
        if self.format == "dense":
            gate_up, down = self.gate_up_weight, self.down_weight
            if serve_blocked(gate_up[0]) and serve_blocked(down[0]):
                self.cpu_gate_up = [block(w) for w in gate_up]
                self.cpu_down = [block(w) for w in down]
                self.cpu_matmul, self.cpu_compute_dtype = blocked_matmul, gate_up.dtype
                self.gate_up_weight, self.down_weight = gate_up.new_empty(0), down.new_empty(0)
            return
        self.cpu_dense = _dense_experts(self._weights("gate_up"), self._weights("down"), dtype)
        if self.cpu_dense is not None:
            return
        gate_up = _pack_experts(self._weights("gate_up"))
        down = _pack_experts(self._weights("down"))
        if gate_up is not None and down is not None:
            self.cpu_gate_up, self.cpu_down = gate_up, down
            self.cpu_q4 = ExpertTable.build(gate_up, down)

    def row_major(self) -> None:
        """16-bit experts back from the blocked layout into the stacked row-major buffers (what
        the one-call CPU decode step reads); the blocked copies are released."""
        if self.format == "dense" and self.cpu_matmul is blocked_matmul:
            self.gate_up_weight = torch.stack([unblock(w) for w in self.cpu_gate_up])
            self.down_weight = torch.stack([unblock(w) for w in self.cpu_down])
            self.cpu_gate_up = self.cpu_down = None
            self.cpu_matmul, self.cpu_compute_dtype = int4_matmul, torch.bfloat16

    def _weights(self, proj: str) -> ExpertWeights:
        t = {name: getattr(self, f"{proj}_{name}") for name in self._names}
        if self.format == "dense" and self.cpu_matmul is blocked_matmul:  # read back, stacked
            t["weight"] = torch.stack([unblock(w) for w in getattr(self, f"cpu_{proj}")])
        return ExpertWeights(self.format, t["weight"], t.get("scales"), t.get("qzeros"),
                             t.get("g_idx"), self.group_size, self.contiguous_groups.get(proj))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return fused_moe(x, self._weights("gate_up"), self._weights("down"), topk_weights,
                             topk_ids)
        if self.cpu_dense is not None and use_cpu_kernels(x):
            return _dense_moe(x, self.cpu_dense, topk_weights, topk_ids)
        if (self.cpu_q4 is not None and x.shape[0] == 1 and x.dtype in Q4_DTYPES
                and x.is_contiguous() and use_cpu_kernels(x)):
            return self.cpu_q4(x, topk_weights, topk_ids)
        if self.cpu_gate_up is not None and use_cpu_kernels(x) and (
                self.cpu_matmul is int4_matmul or x.dtype == self.cpu_compute_dtype):
            return grouped_moe_packed(x, self.cpu_gate_up, self.cpu_down, self.cpu_matmul,
                                      topk_weights, topk_ids, self.cpu_compute_dtype)
        return grouped_moe_torch(x, self._weights("gate_up"), self._weights("down"),
                                 topk_weights, topk_ids)


def _dense_experts(gate_up: ExpertWeights, down: ExpertWeights, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both projections of every expert dequantized into ``dtype`` ([E, N, K] each), when each
    expert's matrices are small enough to serve dense (``kernels.cpu_dense``); else None."""
    if not (serve_dense(*gate_up.out_in) and serve_dense(*down.out_in)):
        return None
    return (gate_up.dequantize().to(dtype).contiguous(), down.dequantize().to(dtype).contiguous())


def _dense_moe(x: torch.Tensor, dense: tuple[torch.Tensor, torch.Tensor],
               topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Experts dequantized at load, through the 16-bit experts' path."""
    return grouped_moe_torch(x, ExpertWeights("dense", dense[0]), ExpertWeights("dense", dense[1]),
                             topk_weights, topk_ids)


def _pack_experts(w: ExpertWeights) -> list[Int4Pack] | None:
    """Each expert of a GPTQ/AWQ projection in the CPU int4 layout; None if one cannot be."""
    fmt = format_for(w.format)
    packs = [pack_checkpoint_int4(fmt, w.packed(e), w.group_size) for e in range(w.weight.shape[0])]
    return None if any(p is None for p in packs) else packs


def _sort_by_expert(topk_ids: torch.Tensor, experts: int
                    ) -> tuple[torch.Tensor | None, list[tuple[int, int, int]]]:
    """(token, expert) pairs sorted by expert: the order, and (expert, start, end) of each
    expert's contiguous slice, for the experts that got tokens. One token (decode at batch 1)
    keeps its slot order (order None): its top-k experts are distinct, one slice each, with no
    argsort, bincount or gathers; the results are the same values in the same slots."""
    if topk_ids.shape[0] == 1:
        return None, [(e, j, j + 1) for j, e in enumerate(topk_ids[0].tolist())]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    spans = []
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=experts).tolist()):
        if n:
            spans.append((e, start, start + n))
            start += n
    return order, spans


def _routed_rows(x: torch.Tensor, order: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """The token row of each (token, expert) pair in ``order`` (None: one token, slot order)."""
    return x.expand(top_k, -1) if order is None else x[order // top_k]


def _combine(out: torch.Tensor, order: torch.Tensor | None, topk_weights: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """Each token's expert outputs (``out`` in expert order) weighted and summed, in fp32."""
    tokens, top_k = topk_weights.shape
    if tokens == 1 and order is None:  # one token: [1, k] @ [k, H], the same sum in one call
        w = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        y = w @ (out if out.dtype == torch.float32 else out.float())
        return y if dtype == torch.float32 else y.to(dtype)
    pairs = out
    if order is not None:
        pairs = torch.empty_like(out)
        pairs[order] = out
    y = pairs.view(tokens, top_k, -1).float() * topk_weights.float().unsqueeze(-1)
    return y.sum(dim=1).to(dtype)


def grouped_moe_torch(x: torch.Tensor, w_gate_up: ExpertWeights, w_down: ExpertWeights,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe``'s math for a CPU: (token, expert) pairs sorted by expert, one contiguous
    slice per expert that got tokens, only those experts' weights touched."""
    order, spans = _sort_by_expert(topk_ids, w_gate_up.weight.shape[0])
    xs = _routed_rows(x, order, topk_ids.shape[1])
    gate_up = torch.empty(xs.shape[0], w_gate_up.out_in[0], device=x.device, dtype=x.dtype)
    for e, a, b in spans:
        torch.mm(xs[a:b], w_gate_up.matrix(e).to(x.dtype).T, out=gate_up[a:b])
    act = silu_and_mul(gate_up)
    out = torch.empty(xs.shape[0], w_down.out_in[0], device=x.device, dtype=x.dtype)
    for e, a, b in spans:
        torch.mm(act[a:b], w_down.matrix(e).to(x.dtype).T, out=out[a:b])
    return _combine(out, order, topk_weights, x.dtype)


def grouped_moe_packed(x: torch.Tensor, gate_up: list, down: list, matmul: Callable,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``grouped_moe_torch`` over experts converted for a CPU kernel (``gate_up[e]`` and
    ``down[e]`` its packs, ``matmul(x, pack)``) that computes in ``dtype`` (the 4-bit kernels in
    bf16), so the routed activations are rounded to it once here rather than on every call, and
    the expert outputs stay in it until the fp32 weighting (the same values as casting around
    each call)."""
    order, spans = _sort_by_expert(topk_ids, len(gate_up))
    if order is None:  # one token: no scratch buffers, slices or copies between the calls
        xb = x if x.dtype == dtype else x.to(dtype)
        act = silu_and_mul(torch.cat([matmul(xb, gate_up[e]) for e, _, _ in spans]))
        out = torch.cat([matmul(a, down[e])
                         for a, (e, _, _) in zip(act.split(1), spans, strict=True)])
        return _combine(out, None, topk_weights, x.dtype)
    xs = _routed_rows(x, order, topk_ids.shape[1]).to(dtype)
    h = torch.empty(xs.shape[0], gate_up[0].out_features, dtype=dtype)
    for e, a, b in spans:
        h[a:b] = matmul(xs[a:b], gate_up[e])
    act = silu_and_mul(h)
    out = torch.empty(xs.shape[0], down[0].out_features, dtype=dtype)
    for e, a, b in spans:
        out[a:b] = matmul(act[a:b], down[e])
    return _combine(out, order, topk_weights, x.dtype)


class ExpertLoop(nn.Module):
    """Experts as separate linears; each forward visits only the experts that got tokens."""

    def __init__(self, gate: list[Linear], up: list[Linear], down: list[Linear]):
        super().__init__()
        self.gate, self.up, self.down = nn.ModuleList(gate), nn.ModuleList(up), nn.ModuleList(down)
        self.cpu_gate_up: list[NF4Pack] | None = None
        self.cpu_down: list[NF4Pack] | None = None
        self.cpu_dense: tuple[torch.Tensor, torch.Tensor] | None = None
        # NF4 experts stacked for the fused kernel (``stack_nf4``), on the device they were
        # stacked on; False where they cannot be
        self.gpu_fused: tuple[ExpertWeights, ExpertWeights] | None | bool = None

    @property
    def cpu_packs(self) -> list[NF4Pack]:
        return [*(self.cpu_gate_up or ()), *(self.cpu_down or ())]

    def pack_for_cpu(self, dtype: torch.dtype = torch.float32) -> None:
        """Small experts (``kernels.cpu_dense``): every expert's gate|up and down dequantized
        into ``dtype`` and stacked, run as 16-bit experts are. NF4 experts: gate and up of each
        expert as one pack for bitsandbytes' CPU kernel (one call for both), down as another, run
        by ``grouped_moe_packed``; other layouts (or NF4 shapes the kernel cannot hold) convert
        each linear on its own."""
        linears = (*self.gate, *self.up, *self.down)
        g, d = self.gate[0], self.down[0]
        if serve_dense(2 * g.out_features, g.in_features) and serve_dense(d.out_features,
                                                                          d.in_features):
            gate_up = [torch.cat([a.dequantized(), b.dequantized()])
                       for a, b in zip(self.gate, self.up, strict=True)]
            self.cpu_dense = (torch.stack(gate_up).to(dtype).contiguous(),
                              torch.stack([m.dequantized() for m in self.down]).to(dtype)
                              .contiguous())
            return
        if all(isinstance(m, NF4Linear) for m in linears):
            merged = [concat_rows([g.nf4, u.nf4]) for g, u in zip(self.gate, self.up, strict=True)]
            gate_up = [None if w is None else pack_nf4_cpu(w) for w in merged]
            down = [pack_nf4_cpu(d.nf4) for d in self.down]
            if None not in gate_up and None not in down:
                self.cpu_gate_up, self.cpu_down = gate_up, down
                for g, u, w in zip(self.gate, self.up, merged, strict=True):
                    # the reference linears read views of the merged bytes: one published copy
                    split = g.nf4.packed.numel()
                    g.nf4 = dataclasses.replace(g.nf4, packed=w.packed[:split])
                    u.nf4 = dataclasses.replace(u.nf4, packed=w.packed[split:])
                return
        for m in linears:
            if hasattr(m, "pack_for_cpu"):
                m.pack_for_cpu(dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            fused = self._stacked_nf4(x.device)
            if fused is not None:
                return fused_moe(x, *fused, topk_weights, topk_ids)
            return self._every_expert(x, topk_weights, topk_ids)
        if self.cpu_dense is not None and use_cpu_kernels(x):
            return _dense_moe(x, self.cpu_dense, topk_weights, topk_ids)
        if self.cpu_gate_up is not None and use_cpu_kernels(x):
            return grouped_moe_packed(x, self.cpu_gate_up, self.cpu_down, nf4_cpu_matmul,
                                      topk_weights, topk_ids)
        out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            token, slot = (topk_ids == e).nonzero(as_tuple=True)
            h = x[token]
            act = silu_and_mul(torch.cat([self.gate[e](h), self.up[e](h)], dim=-1))
            y = self.down[e](act).float() * topk_weights[token, slot, None].float()
            out.index_add_(0, token, y)
        return out.to(x.dtype)

    def _stacked_nf4(self, device: torch.device) -> tuple[ExpertWeights, ExpertWeights] | None:
        """The NF4 experts stacked on ``device`` (built once, outside a CUDA graph capture: the
        model runner's eager warm-up forward comes first), or None."""
        if self.gpu_fused is False:
            return None
        if self.gpu_fused is None or self.gpu_fused[0].weight.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self.gpu_fused = stack_nf4(list(self.gate), list(self.up), list(self.down)) or False
        return self.gpu_fused or None

    def _every_expert(self, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
        """The GPU path: every expert on every token, weighted 0 where not routed. Asking which
        experts got tokens would read the device back (a host sync per layer, no CUDA graph);
        this reads every expert instead, the price of a layout the fused kernel cannot read."""
        routing = torch.zeros(x.shape[0], len(self.gate), device=x.device, dtype=torch.float32)
        routing.scatter_(1, topk_ids.long(), topk_weights.float())
        out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
        for e in range(len(self.gate)):
            act = silu_and_mul(torch.cat([self.gate[e](x), self.up[e](x)], dim=-1))
            out += self.down[e](act).float() * routing[:, e : e + 1]
        return out.to(x.dtype)


def stack_experts(gate: list[Linear], up: list[Linear], down: list[Linear]) -> nn.Module:
    """``FusedExperts`` when the kernel reads the layout, else an ``ExpertLoop``."""
    kinds = {type(m) for m in (*gate, *up, *down)}
    if kinds == {DenseLinear}:
        return FusedExperts(
            "dense",
            {"weight": torch.stack([torch.cat([g.weight, u.weight]) for g, u in zip(gate, up, strict=True)])},
            {"weight": torch.stack([d.weight for d in down])},
        )
    if kinds == {GPTQLinear} and all(m.bits == 4 for m in (*gate, *up, *down)) and all(
        torch.equal(g.g_idx, u.g_idx) for g, u in zip(gate, up, strict=True)
    ):
        return FusedExperts(GPTQ.kind, _stack_packed(gate, up, ("qweight", "qzeros", "scales"),
                                                  {"g_idx": [g.g_idx for g in gate]}),
                            _stack_packed(down, None, ("qweight", "qzeros", "scales"),
                                          {"g_idx": [d.g_idx for d in down]}),
                            contiguous_groups={"gate_up": _shared_group(gate),
                                               "down": _shared_group(down)})
    if kinds == {AWQLinear} and len({m.group_size for m in (*gate, *up, *down)}) == 1:
        names = ("qweight", "qzeros", "scales")
        return FusedExperts(AWQ.kind, _stack_packed(gate, up, names, {}),
                            _stack_packed(down, None, names, {}), gate[0].group_size)
    return ExpertLoop(gate, up, down)


def stack_nf4(gate: list[Linear], up: list[Linear], down: list[Linear]
              ) -> tuple[ExpertWeights, ExpertWeights] | None:
    """NF4 experts as the fused kernel's two stacked projections (gate above up), or None where
    it cannot read them (another layout; block sizes, code tables or shapes that differ; blocks
    straddling rows). Each linear is rebound to a view of the stacked bytes and absmax, so one
    copy stays in memory: with whole blocks per row, an expert's gate|up is its gate's bytes and
    absmax followed by its up's."""
    linears = (*gate, *up, *down)
    if not all(isinstance(m, NF4Linear) for m in linears):
        return None
    first = gate[0].nf4
    if any(m.nf4.blocksize != first.blocksize or m.nf4.shape[1] % first.blocksize
           or not torch.equal(m.nf4.quant_map, first.quant_map) for m in linears) or any(
            len({m.nf4.shape for m in part}) > 1 for part in (gate, up, down)):
        return None
    stacked = []
    for owners in ([(g, u) for g, u in zip(gate, up, strict=True)], [(d,) for d in down]):
        n, k = sum(m.nf4.shape[0] for m in owners[0]), owners[0][0].nf4.shape[1]
        dev = first.packed.device
        packed = torch.empty(len(owners), n * k // 2, dtype=torch.uint8, device=dev)
        absmax = torch.empty(len(owners), n * k // first.blocksize, dtype=torch.float32,
                             device=dev)
        for e, parts in enumerate(owners):
            byte = block = 0
            for m in parts:
                w = m.nf4
                nbytes, nblocks = w.packed.numel(), w.absmax.numel()
                packed[e, byte:byte + nbytes] = w.packed.reshape(-1)
                absmax[e, block:block + nblocks] = w.absmax_fp32()
                m.nf4 = dataclasses.replace(
                    w, packed=packed[e, byte:byte + nbytes].view(w.packed.shape),
                    absmax=absmax[e, block:block + nblocks])
                byte, block = byte + nbytes, block + nblocks
        stacked.append(ExpertWeights(NF4.kind, packed, scales=absmax, group_size=first.blocksize,
                                     quant_map=first.quant_map, shape=(n, k)))
    return stacked[0], stacked[1]


def _shared_group(layers: list[GPTQLinear]) -> int | None:
    """The group size every one of ``layers`` has in contiguous groups, else None."""
    groups = {m.contiguous_group for m in layers}
    return groups.pop() if len(groups) == 1 else None


def _stack_packed(first: list[Linear], second: list[Linear] | None, names: tuple[str, ...],
                  extra: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack packed tensors over experts; with ``second``, concatenate along the output dim."""
    out = {}
    for name in names:
        per_expert = [getattr(m, name) for m in first]
        if second is not None:
            per_expert = [torch.cat([a, getattr(b, name)], dim=1)
                          for a, b in zip(per_expert, second, strict=True)]
        out["weight" if name == "qweight" else name] = torch.stack(per_expert)
    out.update({k: torch.stack(v) for k, v in extra.items()})
    return out


class MoE(nn.Module):
    """Top-k routing over the experts, plus a shared expert (sigmoid-gated or always on) if
    present. Softmax routing by default; with a sigmoid ``rule`` (GLM-4.5), or a softmax one
    with a selection bias (ERNIE-4.5), the router runs in fp32, as the family's forward does, and
    selects with its correction bias (and groups)."""

    def __init__(self, router: Linear, experts: nn.Module, top_k: int, renormalize: bool,
                 shared_expert: nn.Module | None = None, shared_gate: Linear | None = None,
                 rule: RoutingRule | None = None):
        super().__init__()
        self.router, self.experts = router, experts
        self.top_k, self.renormalize = top_k, renormalize
        self.shared_expert, self.shared_gate = shared_expert, shared_gate
        biased = rule is not None and (rule.scoring == "sigmoid" or rule.bias is not None)
        self.rule = rule if biased else None
        # the correction bias as a buffer, so that it follows the model to its device
        self.register_buffer("correction", None if self.rule is None else self.rule.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rule is not None:
            weights, ids = self.rule.select(self.router(x.float()), bias=self.correction)
        else:
            logits = self.router(x)
            probs = torch.softmax(logits.float(), dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out
