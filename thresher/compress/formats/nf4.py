"""bitsandbytes NF4 serialization, as transformers writes a ``Linear4bit``'s state dict.

Per module: ``weight`` uint8 [numel / 2, 1] (two codes per byte, first in the high nibble),
``weight.absmax``, ``weight.quant_map``, with double quantization ``weight.nested_absmax`` and
``weight.nested_quant_map``, and ``weight.quant_state.bitsandbytes__nf4`` (a uint8 tensor holding
the JSON of the non-tensor fields: blocksize, dtype, shape, nested_blocksize, ...). This is
bitsandbytes' own ``QuantState.as_dict(packed=True)``.
"""

from __future__ import annotations

import torch

from thresher.compress.nf4 import NF4Weight

STATE_KEY = "weight.quant_state.bitsandbytes__nf4"


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
