"""What an artifact's ``quantization_config`` says about its packed weights.

The one parser of that block: the dequantizing loader (``models.quantized``) and the serving
engine both ask it which layout the packed tensors use, so they accept and refuse the same
artifacts and call each layout by the same name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from thresher.errors import ArtifactError

Kind = Literal["gptq", "awq", "nf4"]


@dataclass(frozen=True)
class PackedFormat:
    """The layout of an artifact's quantized linear layers."""

    kind: Kind  # gptq: GPTQ v1; awq: AWQ gemm; nf4: bitsandbytes NF4
    bits: int = 4
    group_size: int = -1  # -1: one group per row; nf4: the absmax block size


def packed_format(config: Any, path: str | Path) -> PackedFormat | None:
    """The packed layout ``config.quantization_config`` names (a dict or a transformers
    quantization config object); None when the artifact holds plain 16/32-bit weights."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq":
        return PackedFormat("gptq", int(qc["bits"]), int(qc.get("group_size", -1)))
    if method == "awq" and qc.get("version", "gemm") == "gemm" and qc.get("bits") == 4:
        return PackedFormat("awq", 4, int(qc.get("group_size", 128)))
    if method == "bitsandbytes" and qc.get("load_in_4bit") and qc.get("bnb_4bit_quant_type") == "nf4":
        return PackedFormat("nf4", 4, 64)
    raise ArtifactError(f"{path}: unsupported quantization_config {qc}; thresher reads GPTQ v1, "
                        "AWQ gemm (4-bit) and bitsandbytes NF4 artifacts, or plain 16-bit ones")
