"""bitsandbytes NF4 serialization, as transformers writes a ``Linear4bit``'s state dict.

Per module: ``weight`` uint8 [numel / 2, 1] (two codes per byte, first in the high nibble),
``weight.absmax``, ``weight.quant_map``, with double quantization ``weight.nested_absmax`` and
``weight.nested_quant_map``, and ``weight.quant_state.bitsandbytes__nf4`` (a uint8 tensor holding
the JSON of the non-tensor fields: blocksize, dtype, shape, nested_blocksize, ...). This is
bitsandbytes' own ``QuantState.as_dict(packed=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # bitsandbytes costs ~200 MB of resident memory: imported only for NF4 work
    import bitsandbytes.functional as bnbf

STATE_KEY = "weight.quant_state.bitsandbytes__nf4"


@dataclass
class NF4Weight:
    """One matrix in bitsandbytes' 4-bit representation: packed bytes plus its QuantState."""

    packed: torch.Tensor  # uint8 [numel / 2, 1]
    state: bnbf.QuantState

    def dequantize(self) -> torch.Tensor:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(self.packed, self.state, quant_type="nf4").float()

    @property
    def shape(self) -> torch.Size:
        return self.state.shape


def pack_nf4(w: NF4Weight) -> dict[str, torch.Tensor]:
    """Tensors relative to the module (``weight``, ``weight.absmax``, ...)."""
    out = {"weight": w.packed}
    for key, value in w.state.as_dict(packed=True).items():
        out[f"weight.{key}"] = value
    return out


def unpack_nf4(tensors: dict[str, torch.Tensor]) -> NF4Weight:
    import bitsandbytes.functional as bnbf  # lazily: its import alone holds ~200 MB

    state = {k.removeprefix("weight."): v for k, v in tensors.items() if k != "weight"}
    return NF4Weight(packed=tensors["weight"], state=bnbf.QuantState.from_dict(state, "cpu"))


def quantization_config(double_quant: bool, compute_dtype: str, skip_modules: list[str]) -> dict:
    return {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": double_quant,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": skip_modules,
    }
