"""NF4 (QLoRA, Dettmers et al., arXiv 2305.14314) through bitsandbytes' functional API.

16 codes at the quantiles of a normal distribution, block-wise absmax scaling (block 64), two codes
per byte (first in the high nibble); double quantization re-quantizes the absmax constants to 8
bits. bitsandbytes quantizes and dequantizes NF4 on the CPU, so every expert matrix is quantized
here directly (transformers' own 4-bit loading leaves fused experts in full precision), from a
host copy when the layer is on a GPU.
"""

from __future__ import annotations

import torch

from thresher.formats.nf4 import NF4Weight, bitsandbytes_functional

BLOCK_SIZE = 64


def nf4_quantize(w: torch.Tensor, double_quant: bool, dtype: torch.dtype) -> NF4Weight:
    """Quantize ``w`` (held as ``dtype``, the dtype the artifact dequantizes to) to NF4."""
    packed, state = bitsandbytes_functional().quantize_4bit(
        w.detach().to("cpu", dtype).contiguous(), blocksize=BLOCK_SIZE,
        compress_statistics=double_quant,
        quant_type="nf4", quant_storage=torch.uint8,
    )
    return NF4Weight.from_quant_state(packed, state)
