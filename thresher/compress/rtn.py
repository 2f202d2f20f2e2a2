"""Round-to-nearest as the integer matrix the GPTQ and AWQ checkpoint formats pack."""

from __future__ import annotations

import torch

from thresher.formats.quantized import QuantizedWeight
from thresher.quant.grid import GridSpec
from thresher.quant.rtn import round_to_nearest


def rtn_quantize(w: torch.Tensor, spec: GridSpec, group_size: int) -> QuantizedWeight:
    """Each (row, group) gets its own min-max grid; each weight rounds to the nearest code."""
    cols = w.shape[1]
    gs = cols if group_size == -1 else group_size
    codes, scales, zeros = round_to_nearest(w, spec, group_size)
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros,
                           g_idx=(torch.arange(cols, device=w.device) // gs).to(torch.int32),
                           bits=spec.bits, group_size=group_size)
