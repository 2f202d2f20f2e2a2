"""Round-to-nearest: the data-free baseline every calibrated method has to beat."""

from __future__ import annotations

import torch

from thresher.compress.quantizer import GridSpec, quantize_grouped
from thresher.formats.quantized import QuantizedWeight


def rtn_quantize(w: torch.Tensor, spec: GridSpec, group_size: int) -> QuantizedWeight:
    """Each (row, group) gets its own min-max grid; each weight rounds to the nearest code."""
    return quantize_grouped(w, spec, group_size)
