"""What an artifact's ``quantization_config`` says about its packed weights.

The one parser of that block: the dequantizing loader (``models.quantized``), the serving engine
and the GGUF exporter all ask it which layout the packed tensors use, so they accept and refuse
the same artifacts; each format in ``formats.registry`` reads its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from thresher.errors import ArtifactError
from thresher.formats.base import CheckpointFormat
from thresher.formats.gptq import dynamic_override
from thresher.formats.registry import FORMATS

Kind = Literal["gptq", "awq", "nf4"]


@dataclass(frozen=True)
class PackedFormat:
    """The layout of an artifact's quantized linear layers."""

    kind: Kind  # gptq: GPTQ v1; awq: AWQ gemm; nf4: bitsandbytes NF4
    bits: int = 4
    group_size: int = -1  # -1: one group per row; nf4: the absmax block size
    dynamic: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()  # gptq per-module rules

    def for_module(self, name: str) -> PackedFormat | None:
        """The layout of the module ``name`` (hub-canonical) under the ``dynamic`` rules of a
        mixed-width GPTQ artifact; None when a rule says it is not quantized."""
        if not self.dynamic:
            return self
        fields = dynamic_override({p: dict(f) for p, f in self.dynamic}, name)
        if fields is None:
            return None
        return replace(self, bits=int(fields.get("bits", self.bits)),
                       group_size=int(fields.get("group_size", self.group_size)))

    @property
    def mixed(self) -> bool:
        return bool(self.dynamic)

    @property
    def format(self) -> CheckpointFormat:
        """The format object that names, checks, unpacks and dequantizes these tensors."""
        return FORMATS[self.kind]


def packed_format(config: Any, path: str | Path) -> PackedFormat | None:
    """The packed layout ``config.quantization_config`` names (a dict or a transformers
    quantization config object); None when the artifact holds plain 16/32-bit weights."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    for fmt in FORMATS.values():
        fields = fmt.read_config(qc)
        if fields is not None:
            return PackedFormat(fmt.kind, **fields)  # type: ignore[arg-type]
    raise ArtifactError(f"{path}: unsupported quantization_config {qc}; thresher reads GPTQ v1, "
                        "AWQ gemm (4-bit) and bitsandbytes NF4 artifacts, or plain 16-bit ones")
