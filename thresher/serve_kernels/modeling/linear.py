"""Linear layers that hold their weight exactly as the artifact publishes it.

One class per on-disk layout: 16-bit (``weight`` [N, K]), GPTQ v1 (``qweight/qzeros/scales/g_idx``),
AWQ gemm (``qweight/qzeros/scales``) and bitsandbytes NF4 (``weight`` bytes + quant state). The
packed tensors are kept as published; each forward calls the matching kernel, which dequantizes
tile by tile (Triton) or, on a CPU, runs the kernel's PyTorch reference. ``pack_for_cpu`` (called
by the loader for a CPU model) adds a copy of each 4-bit GPTQ/AWQ weight in the layout of torch's
CPU int4 kernel (and of each per-channel 8-bit GPTQ weight for its int8 kernel, and of each NF4
weight for bitsandbytes' CPU NF4 kernel where the CPU has AVX512-BF16), which CPU forwards then use
instead of dequantizing the whole matrix per call. A quantized matrix small enough that a dense
matmul beats its packed kernel (``kernels.cpu_dense``) is instead dequantized once, into
``cpu_dense`` in the serving dtype, and runs as a 16-bit layer would. A large 16-bit matrix is
reordered into oneDNN's blocked layout (``kernels.cpu_blocked``), a narrow one (a router) gets an
fp32 copy.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from thresher.errors import ArtifactError
from thresher.formats.awq import AWQ
from thresher.formats.bits import pack_along_rows
from thresher.formats.config import PackedFormat
from thresher.formats.gptq import GPTQ
from thresher.formats.nf4 import NF4, NF4Weight, concat_rows
from thresher.formats.registry import FORMATS
from thresher.models.checkpoint import CheckpointReader
from thresher.serve_kernels.kernels import awq_matmul, gptq_matmul, nf4_matmul
from thresher.serve_kernels.kernels.backend import use_cpu_kernels
from thresher.serve_kernels.kernels.cpu_blocked import (
    BlockedWeight,
    block,
    blocked_matmul,
    serve_blocked,
    unblock,
)
from thresher.serve_kernels.kernels.cpu_dense import serve_dense
from thresher.serve_kernels.kernels.cpu_int4 import (
    Int4Pack,
    int4_matmul,
    pack_checkpoint_int4,
)
from thresher.serve_kernels.kernels.cpu_int8 import (
    Int8Pack,
    Q8Pack,
    int8_matmul,
    pack_int8,
    pack_q8,
    q8_matmul,
)
from thresher.serve_kernels.kernels.cpu_nf4 import (
    NF4Pack,
    nf4_cpu_matmul,
    nf4_fp32_holds,
    nf4_fp32_matmul,
    pack_nf4_cpu,
)
from thresher.serve_kernels.kernels.nf4 import nf4_dequantize

NARROW_ROWS = 16  # a 16-bit matrix with at most this many rows (a router) runs in fp32 on a CPU


class DenseLinear(nn.Module):
    """A 16-bit (or fp32) weight [N, K].

    On a CPU torch's 16-bit GEMM is slow for narrow outputs: a router's [1, 1024] x [1024, 8]
    takes 23 us in bf16 and 9 us in fp32 with both casts, and an MoE has one per layer
    (``benchmarks/engine/cpu_small_matrices.py --narrow``: up to 16 rows the fp32 copy wins at 1 and 16
    tokens, with 1 and 2 threads; wider, it loses at 16 tokens on one thread). ``pack_for_cpu``
    therefore keeps an fp32 copy of a 16-bit matrix of at most ``NARROW_ROWS`` rows; the product
    is rounded to the activation dtype once, as the 16-bit GEMM (which accumulates in fp32)
    rounds it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tied: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape
        self.tied = tied  # the weight is another tensor's storage (an LM head tied to embeddings)
        self.cpu_fp32: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.cpu_blocked: BlockedWeight | None = None

    @property
    def cpu_packs(self) -> list[BlockedWeight]:
        return [] if self.cpu_blocked is None else [self.cpu_blocked]

    def row_major(self) -> torch.Tensor:
        """W [N, K] in the serving dtype (read back from the blocked layout if it is there)."""
        return self.weight if self.cpu_blocked is None else unblock(self.cpu_blocked)

    def dequantized(self) -> torch.Tensor:
        return self.row_major().float()

    def pack_for_cpu(self, dtype: torch.dtype = torch.float32) -> None:
        """An fp32 copy of a narrow 16-bit matrix; a wide one into oneDNN's blocked layout
        (``kernels.cpu_blocked``), its row-major buffer released unless it is shared."""
        if self.weight.dtype != torch.float32 and self.out_features <= NARROW_ROWS:
            bias = None if self.bias is None else self.bias.float()
            self.cpu_fp32 = (self.weight.float(), bias)
        elif not self.tied and serve_blocked(self.weight):
            self.cpu_blocked = block(self.weight)
            self.weight = self.weight.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_fp32 is not None and x.dtype != torch.float32 and use_cpu_kernels(x):
            return nn.functional.linear(x.float(), *self.cpu_fp32).to(x.dtype)
        if self.cpu_blocked is not None:
            if x.dtype == self.cpu_blocked.weight.dtype and use_cpu_kernels(x):
                return blocked_matmul(x, self.cpu_blocked, self.bias)
            return nn.functional.linear(x, self.row_major(), self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


def dense_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """x @ weight.T (+ bias) with a matrix dequantized at load (``cpu_dense``)."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return nn.functional.linear(x, weight, bias)


def _dense_copy(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """The layer's matrix dequantized into ``dtype`` when it is small enough to serve dense."""
    if not serve_dense(layer.out_features, layer.in_features):
        return None
    return layer.dequantized().to(dtype).contiguous()


class GPTQLinear(nn.Module):
    """A GPTQ v1 weight; 4-bit runs the W4A16 kernel, other widths unpack per call."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, group_size: int, bias: torch.Tensor | None):
        super().__init__()
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                        ("g_idx", g_idx.int()), ("bias", bias)):
            self.register_buffer(name, t)
        self.bits, self.group_size = bits, group_size
        self.out_features, self.in_features = GPTQ.matrix_shape({"qweight": qweight.shape}, bits)
        self.cpu_pack: Int4Pack | Q8Pack | Int8Pack | None = None
        self.cpu_dense: torch.Tensor | None = None
        size = self.in_features if group_size == -1 else group_size
        contiguous = torch.equal(g_idx.cpu().long(), torch.arange(self.in_features) // size)
        self.contiguous_group = group_size if contiguous else None  # grouped W4A16 kernel

    @classmethod
    def from_packed(cls, tensors: dict[str, torch.Tensor], quant: PackedFormat,
                    bias: torch.Tensor | None) -> GPTQLinear:
        return cls(*(tensors[n] for n in GPTQ.tensors), quant.bits, quant.group_size, bias)

    @property
    def cpu_packs(self) -> list[Int4Pack | Q8Pack | Int8Pack]:
        return [] if self.cpu_pack is None else [self.cpu_pack]

    def packed(self) -> dict[str, torch.Tensor]:
        """The tensors under the format's names (an 8-bit qweight rebuilt from the CPU pack's
        codes, which replace it)."""
        tensors = {n: getattr(self, n) for n in GPTQ.tensors}
        if tensors["qweight"] is None:
            tensors["qweight"] = pack_along_rows(self.cpu_pack.weight.T.to(torch.int32), 8)
        return tensors

    def dequantized(self) -> torch.Tensor:
        """W [N, K] in fp32, as the dequantizing reference computes it."""
        return GPTQ.dequantize(self.packed(), self.bits, self.group_size)

    def pack_for_cpu(self, dtype: torch.dtype = torch.float32) -> None:
        """Dequantize a small matrix into ``dtype`` (``cpu_dense``), else convert a 4-bit weight
        for a CPU int4 kernel, an 8-bit one for thresher's 8-bit kernel or (per-channel, where
        that does not load) torch's int8 kernel (left unset where no kernel can hold it)."""
        self.cpu_dense = _dense_copy(self, dtype)
        if self.cpu_dense is not None:
            return
        if self.bits == 4:
            self.cpu_pack = pack_checkpoint_int4(GPTQ, self.packed(), self.group_size)
        elif self.bits == 8:
            qw = GPTQ.unpack(self.packed(), 8, self.group_size)
            self.cpu_pack = pack_q8(qw.codes, qw.scales, qw.zeros, qw.g_idx, self.group_size)
            if self.cpu_pack is not None:
                self.qweight = None  # the pack's codes are the same bytes: one copy in memory
            else:
                self.cpu_pack = pack_int8(qw.codes, qw.scales, qw.zeros, qw.g_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_dense is not None and use_cpu_kernels(x):
            return dense_forward(x, self.cpu_dense, self.bias)
        if self.cpu_pack is not None and use_cpu_kernels(x):
            matmul = (int4_matmul if isinstance(self.cpu_pack, Int4Pack)
                      else q8_matmul if isinstance(self.cpu_pack, Q8Pack) else int8_matmul)
            y = matmul(x, self.cpu_pack)
        elif self.bits == 4:
            y = gptq_matmul(x, self.qweight, self.qzeros, self.scales, self.g_idx,
                            self.contiguous_group)
        else:
            w = self.dequantized()
            y = nn.functional.linear(x.float(), w.to(x.device)).to(x.dtype)
        return y if self.bias is None else y + self.bias


class AWQLinear(nn.Module):
    """A 4-bit AWQ gemm weight."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None):
        super().__init__()
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                        ("bias", bias)):
            self.register_buffer(name, t)
        self.group_size = group_size
        self.out_features, self.in_features = AWQ.matrix_shape({"qweight": qweight.shape}, 4)
        self.cpu_pack: Int4Pack | None = None
        self.cpu_dense: torch.Tensor | None = None

    @classmethod
    def from_packed(cls, tensors: dict[str, torch.Tensor], quant: PackedFormat,
                    bias: torch.Tensor | None) -> AWQLinear:
        return cls(*(tensors[n] for n in AWQ.tensors), quant.group_size, bias)

    @property
    def cpu_packs(self) -> list[Int4Pack]:
        return [] if self.cpu_pack is None else [self.cpu_pack]

    def packed(self) -> dict[str, torch.Tensor]:
        """The tensors under the format's names."""
        return {n: getattr(self, n) for n in AWQ.tensors}

    def dequantized(self) -> torch.Tensor:
        """W [N, K] in fp32, as the dequantizing reference computes it."""
        return AWQ.dequantize(self.packed(), 4, self.group_size)

    def pack_for_cpu(self, dtype: torch.dtype = torch.float32) -> None:
        """Dequantize a small matrix into ``dtype`` (``cpu_dense``), else convert the weight for
        the CPU int4 kernel (left unset where it cannot hold it)."""
        self.cpu_dense = _dense_copy(self, dtype)
        if self.cpu_dense is None:
            self.cpu_pack = pack_checkpoint_int4(AWQ, self.packed(), self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_dense is not None and use_cpu_kernels(x):
            return dense_forward(x, self.cpu_dense, self.bias)
        if self.cpu_pack is not None and use_cpu_kernels(x):
            y = int4_matmul(x, self.cpu_pack)
        else:
            y = awq_matmul(x, self.qweight, self.qzeros, self.scales, self.group_size)
        return y if self.bias is None else y + self.bias


class NF4Linear(nn.Module):
    """A bitsandbytes NF4 weight (absmax double-quantized or not)."""

    def __init__(self, weight: NF4Weight, bias: torch.Tensor | None):
        super().__init__()
        if weight.nested_absmax is not None:  # undo the double quantization once, not per call
            weight = dataclasses.replace(weight, absmax=weight.absmax_fp32(), nested_absmax=None,
                                         nested_quant_map=None)
        self.nf4 = weight
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape
        self.cpu_pack: NF4Pack | None = None
        self.cpu_dense: torch.Tensor | None = None

    @classmethod
    def from_packed(cls, tensors: dict[str, torch.Tensor], quant: PackedFormat,
                    bias: torch.Tensor | None) -> NF4Linear:
        return cls(NF4.unpack(tensors), bias)

    @property
    def cpu_packs(self) -> list[NF4Pack]:
        return [] if self.cpu_pack is None else [self.cpu_pack]

    def dequantized(self) -> torch.Tensor:
        """W [N, K] in fp32, as the dequantizing reference computes it."""
        return nf4_dequantize(self.nf4)

    def pack_for_cpu(self, dtype: torch.dtype = torch.float32) -> None:
        """Dequantize a small matrix into ``dtype`` (``cpu_dense``), else convert the weight for
        bitsandbytes' CPU NF4 kernel (left unset on CPUs without it, or where the kernel cannot
        hold the shape)."""
        self.cpu_dense = _dense_copy(self, dtype)
        if self.cpu_dense is None:
            self.cpu_pack = pack_nf4_cpu(self.nf4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_dense is not None and use_cpu_kernels(x):
            return dense_forward(x, self.cpu_dense, self.bias)
        if self.cpu_pack is not None and use_cpu_kernels(x):
            y = nf4_cpu_matmul(x, self.cpu_pack)
        elif use_cpu_kernels(x) and nf4_fp32_holds(self.nf4):
            y = nf4_fp32_matmul(x, self.nf4)  # the reference's fp32, W from the C pass
        else:
            y = nf4_matmul(x, self.nf4)
        return y if self.bias is None else y + self.bias

    def _apply(self, fn, recurse: bool = True):  # move the packed tensors with the module
        w = self.nf4
        moved = {k: (fn(v) if isinstance(v, torch.Tensor) else v) for k, v in vars(w).items()}
        self.nf4 = NF4Weight(**moved)
        return super()._apply(fn, recurse)


Linear = DenseLinear | GPTQLinear | AWQLinear | NF4Linear


class ConcatLinear(nn.Module):
    """Several linears on the same input, outputs concatenated (for layouts kept apart)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.cpu_dense: torch.Tensor | None = None
        self.cpu_bias: torch.Tensor | None = None

    def pack_for_cpu(self, dtype: torch.dtype = torch.float32) -> None:
        """Convert each part; when every part ends up dense (16-bit, or quantized and small
        enough for ``cpu_dense``), one matrix of the parts' rows serves all of them in one call
        (act-order GPTQ q/k/v, whose g_idx differ, are kept apart otherwise)."""
        for p in self.parts:
            pack_for_cpu(p, dtype)
        dense = [p.row_major() if isinstance(p, DenseLinear) else getattr(p, "cpu_dense", None)
                 for p in self.parts]
        if all(w is not None for w in dense):
            self.cpu_dense = torch.cat([w.to(dtype) for w in dense]).contiguous()
            self.cpu_bias = _merged_bias(list(self.parts))
            for p in self.parts:  # the merged copy serves them: one dense copy, not two
                if not isinstance(p, DenseLinear):
                    p.cpu_dense = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_dense is not None and use_cpu_kernels(x):
            return dense_forward(x, self.cpu_dense, self.cpu_bias)
        return torch.cat([p(x) for p in self.parts], dim=-1)


def merge_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear computing ``cat([p(x) for p in parts], -1)``: a single matmul when every part
    is 16-bit (q|k|v, gate|up), or GPTQ / AWQ with the same bits, groups and (GPTQ) g_idx, whose
    packed tensors concatenate exactly along the output dim, or NF4 with whole blocks per row
    (``concat_rows``); else the parts side by side."""
    if all(isinstance(p, DenseLinear) for p in parts):
        return DenseLinear(torch.cat([p.weight for p in parts]), _merged_bias(parts))
    if all(isinstance(p, GPTQLinear) for p in parts) and len(
            {(p.bits, p.group_size) for p in parts}) == 1 and all(
            torch.equal(p.g_idx, parts[0].g_idx) and p.out_features * p.bits % 32 == 0
            for p in parts):  # qzeros words must not straddle two parts
        cat = lambda name: torch.cat([getattr(p, name) for p in parts], dim=1)  # noqa: E731
        return GPTQLinear(cat("qweight"), cat("qzeros"), cat("scales"), parts[0].g_idx,
                          parts[0].bits, parts[0].group_size, _merged_bias(parts))
    if all(isinstance(p, AWQLinear) for p in parts) and len({p.group_size for p in parts}) == 1:
        cat = lambda name: torch.cat([getattr(p, name) for p in parts], dim=1)  # noqa: E731
        return AWQLinear(cat("qweight"), cat("qzeros"), cat("scales"), parts[0].group_size,
                         _merged_bias(parts))
    if all(isinstance(p, NF4Linear) for p in parts):
        merged = concat_rows([p.nf4 for p in parts])
        if merged is not None:
            return NF4Linear(merged, _merged_bias(parts))
    return ConcatLinear(parts)


def _merged_bias(parts: list[nn.Module]) -> torch.Tensor | None:
    """The parts' biases end to end (zeros for a part without one), None if none has one."""
    if all(p.bias is None for p in parts):
        return None
    ref = next(p.bias for p in parts if p.bias is not None)
    return torch.cat([p.bias if p.bias is not None else ref.new_zeros(p.out_features)
                      for p in parts])


def pack_for_cpu(module: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Convert every quantized layer that has a CPU kernel (see ``cpu_int4``), once, at load, or
    dequantize it into the serving ``dtype`` where it is small (``cpu_dense``). A module with its
    own ``pack_for_cpu`` converts its children as it sees fit (an expert loop packs gate and up
    together)."""
    if hasattr(module, "pack_for_cpu"):
        module.pack_for_cpu(dtype)
        return
    for child in module.children():
        pack_for_cpu(child, dtype)


def packed_bytes(module: nn.Module) -> int:
    """Bytes the module's weights occupy in memory (packed forms for quantized layers, CPU
    kernel copies included)."""
    total = sum(b.numel() * b.element_size() for b in module.buffers())
    for m in module.modules():
        total += sum(p.nbytes for p in getattr(m, "cpu_packs", ()))
        for name in ("cpu_dense", "cpu_fp32"):
            copy = getattr(m, name, None)
            total += 0 if copy is None else sum(t.numel() * t.element_size() for t in (
                copy if isinstance(copy, tuple | list) else [copy]) if t is not None)
        if isinstance(m, NF4Linear):
            total += sum(v.numel() * v.element_size() for v in vars(m.nf4).values()
                         if isinstance(v, torch.Tensor))
    return total


PACKED_LINEARS = {GPTQ.kind: GPTQLinear, AWQ.kind: AWQLinear, NF4.kind: NF4Linear}
"""The engine module of each checkpoint format."""


def load_linear(reader: CheckpointReader, prefix: str, quant: PackedFormat | None,
                dtype: torch.dtype, shape: tuple[int, int] | None = None) -> Linear:
    """The linear layer stored under ``prefix`` (e.g. ``model.layers.0.self_attn.q_proj``);
    ``shape`` ([out, in], when known) is checked against its packed tensors."""
    bias = reader.get(f"{prefix}.bias").to(dtype) if f"{prefix}.bias" in reader else None
    own = None if quant is None else quant.for_module(prefix)  # mixed widths: its own
    fmt = None if own is None else own.format
    if fmt is not None and f"{prefix}.{fmt.marker}" in reader:
        tensors = {n: reader.get(f"{prefix}.{n}") for n in fmt.tensors if f"{prefix}.{n}" in reader}
        if shape is not None:
            fmt.check(tensors, *shape, own.bits, own.group_size, f"{reader.path}: {prefix}")
        return PACKED_LINEARS[fmt.kind].from_packed(tensors, own, bias)
    packed = [f.kind for f in FORMATS.values() if f"{prefix}.{f.marker}" in reader]
    if packed:
        raise ArtifactError(f"{reader.path}: {prefix} is packed ({' or '.join(packed)}), but "
                            "config.json's quantization_config does not describe it so")
    return DenseLinear(reader.get(f"{prefix}.weight").to(dtype), bias)
