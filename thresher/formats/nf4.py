"""bitsandbytes NF4 serialization, as transformers writes a ``Linear4bit``'s state dict.

Per module: ``weight`` uint8 [numel / 2, 1] (two codes per byte, first in the high nibble),
``weight.absmax``, ``weight.quant_map``, with double quantization ``weight.nested_absmax`` and
``weight.nested_quant_map``, and ``weight.quant_state.bitsandbytes__nf4`` (a uint8 tensor holding
the JSON of the non-tensor fields: blocksize, dtype, shape, nested_blocksize, ...). This is
bitsandbytes' own ``QuantState.as_dict(packed=True)``.

``NF4Weight`` holds those tensors as plain fields, so reading, unpacking and dequantizing an NF4
artifact needs no bitsandbytes (its import alone holds ~200 MB); only quantizing does
(``compress.nf4``). The dequantization reproduces bitsandbytes' ``dequantize_4bit`` bit for bit:
W.flat[i] = quant_map[code_i] * absmax[i // blocksize] in fp32, rounded to the stored dtype.
With double quantization the absmax itself is stored as uint8 codes into ``nested_quant_map``,
scaled per ``nested_blocksize`` codes by ``nested_absmax``, plus ``nested_offset``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from thresher.errors import ArtifactError, CheckpointError
from thresher.formats.base import CheckpointFormat, Shape

if TYPE_CHECKING:
    import bitsandbytes.functional as bnbf

STATE_KEY = "weight.quant_state.bitsandbytes__nf4"
TENSOR_NAMES = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
                "weight.nested_quant_map", STATE_KEY)  # relative to the module; nested_* optional
QUANT_TYPE = "nf4"


@functools.cache
def bitsandbytes_functional() -> Any:
    """``bitsandbytes.functional``, imported on first use, without the warning bitsandbytes' CPU
    backend logs at import when the optional ``kernels`` package is missing (it then runs its own
    native library, which is what thresher uses)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes.functional as bnbf

    return bnbf


@dataclass
class NF4Weight:
    """One matrix in bitsandbytes' NF4 representation: the tensors of a ``Linear4bit``."""

    packed: torch.Tensor  # uint8, numel / 2 bytes ([numel / 2, 1] as bitsandbytes writes it)
    absmax: torch.Tensor  # fp32 [ceil(numel / blocksize)], or uint8 codes with double quant
    quant_map: torch.Tensor  # fp32 [16]
    shape: tuple[int, ...]  # (N, K) = (out_features, in_features)
    blocksize: int = 64
    nested_absmax: torch.Tensor | None = None  # fp32 [ceil(len(absmax) / nested_blocksize)]
    nested_quant_map: torch.Tensor | None = None  # fp32 [256]
    nested_offset: float = 0.0
    nested_blocksize: int = 256
    dtype: torch.dtype = torch.float32  # the dtype quantized, which dequantization rounds to
    nested_dtype: torch.dtype = torch.float32

    @classmethod
    def from_quant_state(cls, packed: torch.Tensor, state: Any) -> NF4Weight:
        """From ``bitsandbytes.functional.quantize_4bit``'s output (packed bytes, QuantState)."""
        nested = {}
        if state.nested:
            nested = dict(nested_absmax=state.state2.absmax, nested_quant_map=state.state2.code,
                          nested_offset=float(state.offset),
                          nested_blocksize=state.state2.blocksize, nested_dtype=state.state2.dtype)
        return cls(packed, state.absmax, state.code, tuple(state.shape), state.blocksize,
                   dtype=state.dtype, **nested)

    @property
    def state(self) -> bnbf.QuantState:
        """This weight's bitsandbytes ``QuantState``, to hand it back to bitsandbytes (imports
        bitsandbytes)."""
        fields = {k.removeprefix("weight."): v for k, v in pack_nf4(self).items() if k != "weight"}
        return bitsandbytes_functional().QuantState.from_dict(fields, self.packed.device)

    def absmax_fp32(self) -> torch.Tensor:
        """Per-block absmax in fp32, dequantizing the double-quantized form if present."""
        if self.nested_absmax is None:
            return self.absmax.float()
        block = torch.arange(self.absmax.numel(), device=self.absmax.device)
        block = block // self.nested_blocksize
        scaled = self.nested_quant_map.float()[self.absmax.long()] * self.nested_absmax.float()[block]
        return scaled + self.nested_offset

    def dequantize_fp32(self) -> torch.Tensor:
        """W as the kernels compute it: quant_map[code] * absmax in fp32, not rounded to
        ``dtype``."""
        n = math.prod(self.shape)
        packed = self.packed.reshape(-1)
        codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
        scale = self.absmax_fp32().repeat_interleave(self.blocksize)[:n]
        return (self.quant_map.float()[codes] * scale).view(self.shape)

    def dequantize(self) -> torch.Tensor:
        """W in float32, equal to ``bitsandbytes.functional.dequantize_4bit(...).float()``."""
        return self.dequantize_fp32().to(self.dtype).float()


def concat_rows(weights: list[NF4Weight]) -> NF4Weight | None:
    """One NF4 weight whose rows are those of ``weights`` in order (q above k above v, gate
    above up), exact: the blocks run along the flattened rows, so with whole blocks per row the
    codes and absmax of each part simply follow each other (the absmax comes out fp32, double
    quantization undone). None when blocks straddle rows or the parts differ otherwise."""
    first = weights[0]
    if first.shape[1] % first.blocksize or any(
            w.shape[1] != first.shape[1] or w.blocksize != first.blocksize
            or w.dtype != first.dtype or not torch.equal(w.quant_map, first.quant_map)
            for w in weights):
        return None
    return NF4Weight(torch.cat([w.packed.reshape(-1) for w in weights]),
                     torch.cat([w.absmax_fp32().float() for w in weights]), first.quant_map,
                     (sum(w.shape[0] for w in weights), first.shape[1]), first.blocksize,
                     dtype=first.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_nf4(w: NF4Weight) -> dict[str, torch.Tensor]:
    """Tensors relative to the module (``weight``, ``weight.absmax``, ...), in the order and with
    the JSON bitsandbytes' ``QuantState.as_dict(packed=True)`` writes."""
    out = {"weight": w.packed, "weight.absmax": w.absmax, "weight.quant_map": w.quant_map}
    fields: dict[str, Any] = {"quant_type": QUANT_TYPE, "blocksize": w.blocksize,
                              "dtype": _dtype_name(w.dtype), "shape": list(w.shape)}
    if w.nested_absmax is not None:
        out["weight.nested_absmax"] = w.nested_absmax
        out["weight.nested_quant_map"] = w.nested_quant_map.clone()
        fields.update(nested_blocksize=w.nested_blocksize, nested_dtype=_dtype_name(w.nested_dtype),
                      nested_offset=w.nested_offset)
    out[STATE_KEY] = torch.tensor(list(json.dumps(fields).encode()), dtype=torch.uint8)
    return out


def unpack_nf4(tensors: Mapping[str, torch.Tensor]) -> NF4Weight:
    """The weight from the tensors ``pack_nf4`` writes (names relative to the module)."""
    fields = json.loads(bytes(tensors[STATE_KEY].tolist()).decode())
    if fields["quant_type"] != QUANT_TYPE:
        raise ArtifactError(f"4-bit quant_type {fields['quant_type']!r}: thresher reads only NF4")
    nested = {}
    if "weight.nested_absmax" in tensors:
        nested = dict(nested_absmax=tensors["weight.nested_absmax"],
                      nested_quant_map=tensors["weight.nested_quant_map"],
                      nested_offset=float(fields["nested_offset"]),
                      nested_blocksize=int(fields["nested_blocksize"]),
                      nested_dtype=getattr(torch, fields["nested_dtype"]))
    return NF4Weight(tensors["weight"], tensors["weight.absmax"], tensors["weight.quant_map"],
                     tuple(fields["shape"]), int(fields["blocksize"]),
                     dtype=getattr(torch, fields["dtype"]), **nested)


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


class NF4Format(CheckpointFormat):
    """bitsandbytes NF4: the layout above; its block size and shape live in the quant state."""

    kind = "nf4"
    marker = STATE_KEY
    tensors = TENSOR_NAMES
    required = ("weight", "weight.absmax", "weight.quant_map", STATE_KEY)
    integer_grid = False

    def packed_shapes(self, out_features: int, in_features: int, bits: int,
                      group_size: int) -> dict[str, Shape]:
        """The code and absmax tensors, ``group_size`` being the absmax block size."""
        numel = out_features * in_features
        return {"weight": (-(-numel // 2), 1), "weight.absmax": (-(-numel // group_size),),
                "weight.quant_map": (16,)}

    def matrix_shape(self, shapes: Mapping[str, Shape], bits: int) -> None:
        return None

    def check(self, tensors: Mapping[str, torch.Tensor], out_features: int, in_features: int,
              bits: int, group_size: int, where: str) -> None:
        """As the base check, with the block size and shape its quant state records."""
        self.require(tensors, where)
        weight = unpack_nf4(tensors)
        if weight.shape != (out_features, in_features):
            raise CheckpointError(f"{where}.{STATE_KEY}: records shape {weight.shape}, not the "
                                  f"[{out_features}, {in_features}] weight of the model")
        super().check(tensors, out_features, in_features, bits, weight.blocksize, where)

    def pack(self, weight: NF4Weight) -> dict[str, torch.Tensor]:
        return pack_nf4(weight)

    def unpack(self, tensors: Mapping[str, torch.Tensor], bits: int = 4,
               group_size: int = 64) -> NF4Weight:
        return unpack_nf4(tensors)

    def read_config(self, qc: Mapping[str, Any]) -> dict[str, Any] | None:
        if not (qc.get("quant_method") == "bitsandbytes" and qc.get("load_in_4bit")
                and qc.get("bnb_4bit_quant_type") == QUANT_TYPE):
            return None
        return {"bits": 4, "group_size": 64}

    def quantization_config(self, **fields: Any) -> dict:
        return quantization_config(**fields)


NF4 = NF4Format()
