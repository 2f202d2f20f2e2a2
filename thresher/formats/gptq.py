"""The GPTQ v1 ``gptq`` checkpoint layout (AutoGPTQ, GPTQModel, transformers, vLLM).

For a linear layer with K inputs and N outputs, group size G:

- ``qweight`` int32 [K * bits / 32, N]: codes packed along K (``bits.pack_along_rows``);
- ``qzeros`` int32 [K / G, N * bits / 32]: zero points packed along N, stored as zero - 1 (v1);
- ``scales`` fp16 [K / G, N];
- ``g_idx`` int32 [K]: the group of each input row (non-monotonic only for a desc_act checkpoint).

Dequantized: W^T[k, n] = scales[g_idx[k], n] * (q[k, n] - (qzeros[g_idx[k], n] + 1)).

Mixed widths follow GPTQModel's ``dynamic`` convention, which vLLM reads: ``quantization_config``
keeps the base ``bits`` and ``dynamic`` maps regexes to overrides, ``{"+:model\\.layers\\.0\\..*":
{"bits": 8}}``; the first pattern that ``re.match``-es a module's name decides (``+:`` or no prefix:
override its fields; ``-:``: the module is not quantized).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from thresher.formats.base import CheckpointFormat, Shape, groups
from thresher.formats.bits import (
    pack_along_cols,
    pack_along_rows,
    unpack_along_cols,
    unpack_along_rows,
)
from thresher.formats.quantized import QuantizedWeight

TENSORS = ("qweight", "qzeros", "scales", "g_idx")
BITS = (2, 3, 4, 8)


def pack_gptq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """A quantized [N, K] weight -> the four v1 tensors (names relative to the module)."""
    if (qw.zeros < 1).any():
        raise ValueError("GPTQ v1 stores zero - 1 unsigned: zero points must be >= 1")
    return {
        "qweight": pack_along_rows(qw.codes.T, qw.bits),
        "qzeros": pack_along_cols((qw.zeros - 1).T.contiguous(), qw.bits),
        "scales": qw.scales.T.contiguous().to(torch.float16),
        "g_idx": qw.g_idx.to(torch.int32),
    }


def unpack_gptq(tensors: Mapping[str, torch.Tensor], bits: int, group_size: int) -> QuantizedWeight:
    """The v1 tensors -> codes, scales and zeros in [N, K] layout."""
    g_idx = tensors["g_idx"].to(torch.int32)
    k = g_idx.numel()
    n = tensors["qweight"].shape[1]
    codes = unpack_along_rows(tensors["qweight"], bits, k).T
    zeros = unpack_along_cols(tensors["qzeros"], bits, n) + 1
    return QuantizedWeight(
        codes=codes.to(torch.uint8).contiguous(),
        scales=tensors["scales"].float().T.contiguous(),
        zeros=zeros.T.contiguous().to(torch.int32),
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
    )


def packed_bits(n: int, k: int, bits: float, group_size: int) -> float:
    """Bits the four tensors of an [n, k] weight take: codes, one fp16 scale and one packed zero
    per (group, output), and g_idx. Linear in ``bits``, so a fractional width prices an average."""
    groups = 1 if group_size == -1 else k // group_size
    return n * k * bits + groups * n * (16 + bits) + 32 * k


def dynamic_override(dynamic: dict[str, dict] | None, module: str) -> dict | None:
    """The override of ``module`` under GPTQModel's ``dynamic`` rules, as vLLM's
    ``get_dynamic_override`` reads them: the first matching pattern wins; ``{}`` when none
    matches, None when a ``-:`` pattern skips the module."""
    for pattern, fields in (dynamic or {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], module):
                return None
        elif re.match(pattern.removeprefix("+:"), module):
            return dict(fields)
    return {}


def module_pattern(modules: list[str]) -> str:
    """A ``+:`` rule matching exactly ``modules`` (siblings: one parent, different last names),
    and the name vLLM gives their fused module (q/k/v -> qkv_proj, gate/up -> gate_up_proj,
    latent attention's q_a/kv_a -> fused_qkv_a_proj), so a server that fuses them reads one width
    for the fused layer."""
    parent = modules[0].rpartition(".")[0]
    names = sorted(m.rpartition(".")[2] for m in modules)
    fused = {("k_proj", "q_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj",
             ("kv_a_proj_with_mqa", "q_a_proj"): "fused_qkv_a_proj"}
    if tuple(names) in fused:
        names.append(fused[tuple(names)])
    alternatives = "|".join(re.escape(n) for n in names)
    tail = re.escape(names[0]) if len(names) == 1 else f"(?:{alternatives})"
    return f"+:{re.escape(parent)}\\.{tail}$"


def quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool, static_groups: bool,
                        damp_percent: float, true_sequential: bool, modules_to_not_convert: list[str],
                        dynamic: dict[str, dict] | None = None) -> dict:
    extra = {"dynamic": dynamic} if dynamic else {}
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": damp_percent,
        "true_sequential": true_sequential,
        "static_groups": static_groups,
        "checkpoint_format": "gptq",
        "lm_head": False,
        "modules_to_not_convert": modules_to_not_convert,
        **extra,
    }


class GPTQFormat(CheckpointFormat):
    """GPTQ v1: the layout above, at 2, 3, 4 or 8 bits."""

    kind = "gptq"
    marker = "qweight"
    tensors = TENSORS
    required = TENSORS
    integer_grid = True
    min_zero = 1  # v1 stores zero - 1 unsigned

    def packed_shapes(self, out_features: int, in_features: int, bits: int,
                      group_size: int) -> dict[str, Shape]:
        g = groups(in_features, group_size)
        return {"qweight": (in_features * bits // 32, out_features),
                "qzeros": (g, out_features * bits // 32), "scales": (g, out_features),
                "g_idx": (in_features,)}

    def matrix_shape(self, shapes: Mapping[str, Shape], bits: int) -> tuple[int, int]:
        qweight = shapes["qweight"]
        return qweight[1], qweight[0] * 32 // bits

    def settings_problem(self, bits: int, group_size: int) -> str | None:
        return None if bits in BITS else f"bits={bits}: the GPTQ format holds {BITS} bits"

    def layout_problem(self, out_features: int, in_features: int, bits: int) -> str | None:
        period = 32 // math.gcd(bits, 32)
        if in_features % period or out_features % period:
            return (f"GPTQ packs {bits}-bit codes in runs of {period} rows and columns (4 and 8 "
                    "bits in runs of 8 and 4)")
        return None

    def pack(self, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        return pack_gptq(weight)

    def unpack(self, tensors: Mapping[str, torch.Tensor], bits: int,
               group_size: int) -> QuantizedWeight:
        return unpack_gptq(tensors, bits, group_size)

    def read_config(self, qc: Mapping[str, Any]) -> dict[str, Any] | None:
        if qc.get("quant_method") != "gptq" or qc.get("checkpoint_format", "gptq") != "gptq":
            return None
        dynamic = tuple((p, tuple(sorted(f.items()))) for p, f in (qc.get("dynamic") or {}).items())
        return {"bits": int(qc["bits"]), "group_size": int(qc.get("group_size", -1)),
                "dynamic": dynamic}

    def quantization_config(self, **fields: Any) -> dict:
        return quantization_config(**fields)


GPTQ = GPTQFormat()
