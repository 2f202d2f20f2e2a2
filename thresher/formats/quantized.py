"""A matrix on a uniform integer grid: codes with a scale and zero per (row, group).

The in-memory form every integer checkpoint format (GPTQ v1, AWQ gemm) packs and unpacks; the
compressors produce it and the loaders rebuild it, so it lives with the formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """Integer codes of one [out, in] matrix with a scale and zero per (row, group).

    ``g_idx[k]`` is the group of input column k; with act-order (without static groups) it is not
    monotonic.
    """

    codes: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # float32 [out, groups], fp16-representable
    zeros: torch.Tensor  # int32 [out, groups]
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    group_size: int  # -1 = one group per row

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        gs = cols if self.group_size == -1 else self.group_size
        if cols % gs == 0 and torch.equal(
                self.g_idx.long(), torch.arange(cols, device=self.g_idx.device) // gs):
            # contiguous groups: a broadcast per group, not a gather per weight (same values)
            codes = self.codes.float().reshape(rows, cols // gs, gs)
            return (self.scales.unsqueeze(2) * (codes - self.zeros.float().unsqueeze(2))
                    ).reshape(rows, cols)
        g = self.g_idx.long()
        return self.scales[:, g] * (self.codes.float() - self.zeros[:, g].float())

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape
