"""Which checkpoint format each method writes, and how each format packs one quantized weight."""

from __future__ import annotations

from collections.abc import Callable

import torch

from thresher.formats.awq import pack_awq
from thresher.formats.gptq import pack_gptq
from thresher.formats.nf4 import pack_nf4

FORMAT_OF_METHOD = {"rtn": "gptq", "gptq": "gptq", "awq": "awq", "nf4": "bitsandbytes"}

PACKERS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "gptq": pack_gptq,
    "awq": pack_awq,
    "bitsandbytes": pack_nf4,
}
