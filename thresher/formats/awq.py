"""The AWQ ``gemm`` checkpoint layout (AutoAWQ, transformers, vLLM); 4-bit only.

For a linear layer with K inputs and N outputs, group size G:

- ``qweight`` int32 [K, N / 8]: word c of row k holds columns 8c..8c+7, nibble i holding column
  8c + AWQ_ORDER[i] (the interleaving the GEMM kernel expects);
- ``qzeros`` int32 [K / G, N / 8]: the true zero points, same interleaving;
- ``scales`` fp16 [K / G, N].

Dequantized: W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from thresher.formats.base import CheckpointFormat, Shape, groups
from thresher.formats.bits import pack_last, unpack_last
from thresher.formats.quantized import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TENSORS = ("qweight", "qzeros", "scales")
BITS = 4


def _pack_interleaved(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit codes -> int32 [R, C / 8] in AWQ's nibble order."""
    return pack_last(values, BITS, AWQ_ORDER)


def _unpack_interleaved(packed: torch.Tensor) -> torch.Tensor:
    return unpack_last(packed, BITS, packed.shape[-1] * 8, AWQ_ORDER)


def pack_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """A 4-bit quantized [N, K] weight with monotonic groups -> the three gemm tensors."""
    if qw.bits != BITS:
        raise ValueError(f"the AWQ gemm format holds 4-bit weights, got {qw.bits}")
    return {
        "qweight": _pack_interleaved(qw.codes.T),
        "qzeros": _pack_interleaved(qw.zeros.T),
        "scales": qw.scales.T.contiguous().to(torch.float16),
    }


def unpack_awq(tensors: Mapping[str, torch.Tensor], group_size: int) -> QuantizedWeight:
    """The gemm tensors -> codes, scales and zeros in [N, K] layout (``group_size`` -1: one
    group)."""
    codes = _unpack_interleaved(tensors["qweight"]).T.contiguous()
    zeros = _unpack_interleaved(tensors["qzeros"]).T.contiguous()
    k = codes.shape[1]
    return QuantizedWeight(
        codes=codes.to(torch.uint8),
        scales=tensors["scales"].float().T.contiguous(),
        zeros=zeros,
        g_idx=(torch.arange(k, device=codes.device) // (k if group_size == -1 else group_size)
               ).to(torch.int32),
        bits=BITS,
        group_size=group_size,
    )


def quantization_config(group_size: int, modules_to_not_convert: list[str]) -> dict:
    return {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }


class AWQFormat(CheckpointFormat):
    """AWQ gemm: the layout above, 4-bit only."""

    kind = "awq"
    marker = "qweight"
    tensors = TENSORS
    required = TENSORS
    integer_grid = True

    def packed_shapes(self, out_features: int, in_features: int, bits: int,
                      group_size: int) -> dict[str, Shape]:
        g = groups(in_features, group_size)
        return {"qweight": (in_features, out_features // 8), "qzeros": (g, out_features // 8),
                "scales": (g, out_features)}

    def matrix_shape(self, shapes: Mapping[str, Shape], bits: int) -> tuple[int, int]:
        qweight = shapes["qweight"]
        return qweight[1] * 8, qweight[0]

    def settings_problem(self, bits: int, group_size: int) -> str | None:
        if bits != BITS:
            return f"bits={bits}: the AWQ gemm format holds {BITS}-bit weights"
        if group_size == -1:
            return ("group_size=-1: the 4-bit AWQ gemm format needs a group size (e.g. 128); AWQ "
                    "at 2, 3 or 8 bits writes the GPTQ format, which allows -1")
        return None

    def layout_problem(self, out_features: int, in_features: int, bits: int) -> str | None:
        return None if out_features % 8 == 0 else "the AWQ gemm format packs 8 outputs per word"

    def pack(self, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        return pack_awq(weight)

    def unpack(self, tensors: Mapping[str, torch.Tensor], bits: int,
               group_size: int) -> QuantizedWeight:
        return unpack_awq(tensors, group_size)

    def read_config(self, qc: Mapping[str, Any]) -> dict[str, Any] | None:
        if (qc.get("quant_method") != "awq" or qc.get("version", "gemm") != "gemm"
                or qc.get("bits") != BITS):
            return None
        return {"bits": BITS, "group_size": int(qc.get("group_size", 128))}

    def quantization_config(self, **fields: Any) -> dict:
        return quantization_config(**fields)


AWQ = AWQFormat()
