"""How each checkpoint format packs one quantized weight (which method writes which format is the
method's own ``format``, in ``thresher.compress.methods``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from thresher.formats.awq import pack_awq
from thresher.formats.gptq import pack_gptq
from thresher.formats.nf4 import pack_nf4

PACKERS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "gptq": pack_gptq,
    "awq": pack_awq,
    "nf4": pack_nf4,
}
