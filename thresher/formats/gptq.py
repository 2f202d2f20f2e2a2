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

import re

import torch

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
        "qweight": pack_along_rows(qw.codes.T.to(torch.int32), qw.bits),
        "qzeros": pack_along_cols((qw.zeros - 1).T.contiguous(), qw.bits),
        "scales": qw.scales.T.contiguous().to(torch.float16),
        "g_idx": qw.g_idx.to(torch.int32),
    }


def unpack_gptq(tensors: dict[str, torch.Tensor], bits: int, group_size: int) -> QuantizedWeight:
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


def dequantize_gptq(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """The float weight [N, K] of a v1 tensor set."""
    return unpack_gptq(tensors, bits, -1).dequantize()


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
