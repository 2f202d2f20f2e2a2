"""The 16 NF4 code values (QLoRA, Dettmers et al., arXiv 2305.14314): quantiles of a standard
normal scaled to [-1, 1], with an exact 0, in the fp32 values bitsandbytes stores as
``quant_map``. A weight is quant_map[code] * absmax of its block."""

from __future__ import annotations

NF4_CODES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
