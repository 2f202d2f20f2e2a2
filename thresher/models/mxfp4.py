"""MXFP4 expert weights on input (gpt-oss hub checkpoints): dequantized as they are read.

OCP microscaling FP4: each row is cut into blocks of 32 values stored as FP4 e2m1 codes, two a
byte (low nibble first), with one e8m0 scale a block (a power of two, biased by 127). The hub
stores ``<name>_blocks`` [..., rows, cols / 32, 16] uint8 and ``<name>_scales`` [..., rows,
cols / 32] uint8 for a weight kept [..., rows, cols] in nn.Linear layout; transformers' gpt-oss
holds the transpose (``[E, in, out]``), which is what ``dequantize`` returns.
"""

from __future__ import annotations

import torch

from thresher.errors import CheckpointError

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
BLOCK = 32
# FP4 e2m1 code -> value (sign bit 3, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = ""
               ) -> torch.Tensor:
    """``<name>_blocks`` and ``<name>_scales`` -> the weight [..., cols, rows] in ``dtype``."""
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8
            or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2):
        raise CheckpointError(
            f"{name}: not MXFP4 (blocks {blocks.dtype} {list(blocks.shape)}, scales "
            f"{scales.dtype} {list(scales.shape)}; expected uint8 [..., rows, cols/32, 16] and "
            "uint8 [..., rows, cols/32])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``dequantize`` (round to nearest, scale = the power of two that fits the
    block's largest magnitude in e2m1's range): weight [..., cols, rows] -> (blocks, scales).
    Writes MXFP4 checkpoints in the hub layout for tests and interop checks."""
    w = weight.transpose(-1, -2).float()
    w = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # 6.0 = 1.5 * 2**2
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    scaled = w / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)
