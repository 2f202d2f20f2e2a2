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
        g = self.g_idx.long()
        return self.scales[:, g] * (self.codes.float() - self.zeros[:, g].float())

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape
