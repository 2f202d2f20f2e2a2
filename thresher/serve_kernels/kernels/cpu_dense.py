"""Small quantized matrices served dense on the CPU: dequantized once, at load.

A packed 4-bit kernel pays off by reading fewer weight bytes. A matrix of a few hundred thousand
weights sits in the CPU's cache, so there are no bytes to save, and the kernel's fixed cost per
call (activations rounded to bf16 and back, the packed layout's setup, act-order's gather) makes
it slower than a dense matmul: on the ``small`` demo a decode step is dispatch, not weight
reading, and its 4-bit variants ran at 0.74-1.0x their 16-bit parent. So on a CPU, a quantized
matrix of at most ``DENSE_MAX_ELEMENTS`` weights is dequantized once at load (in fp32 from its
codes, then cast to the serving dtype) and runs the dense matmul of a 16-bit model. The crossover
was measured with ``benchmarks/engine/cpu_small_matrices.py`` (docs/benchmarks.md, "Small matrices
dense on the CPU"); the memory this adds is at most the threshold's dense bytes per matrix, and
a model whose matrices are larger (the 1 GB benchmark model's smallest 4-bit matrix, a 256 x
1024 k_proj, has twice the threshold) keeps every matrix on its packed kernel. On the one-call C
decode step, which has no per-call cost, the packed kernels win back one sequence (1.1-1.26x on
``small``) and lose batches of 16 (0.84-0.98x): a trade, not a win either way, so the threshold
stayed when measured again there (docs/benchmarks.md).

``THRESHER_CPU_DENSE_MAX`` (weights per matrix) overrides the threshold at load time; 0 keeps
every matrix on its packed kernel (the kernels' own tests pin it so). The published packed
tensors stay with each layer, so ``THRESHER_KERNELS=torch`` still runs the dequantizing
references.
"""

from __future__ import annotations

import os

ENV_VAR = "THRESHER_CPU_DENSE_MAX"
# weights per matrix: 512 x 256 ran 1.4-3.6x faster dense than on either 4-bit kernel at 1 and 16
# rows, 1024 x 512 about even (benchmarks/engine/cpu_small_matrices.py); the 1 GB model's smallest
# 4-bit matrix (k_proj, 256 x 1024) stays above it
DENSE_MAX_ELEMENTS = 512 * 256


def dense_max_elements() -> int:
    """The threshold in force: ``THRESHER_CPU_DENSE_MAX`` if set, else ``DENSE_MAX_ELEMENTS``."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return DENSE_MAX_ELEMENTS
    if not value.isdigit():
        raise ValueError(f"{ENV_VAR}={value!r}: expected a number of weights (0 = never)")
    return int(value)


def serve_dense(out_features: int, in_features: int) -> bool:
    """True when an [out, in] quantized matrix should be dequantized at load on a CPU."""
    return out_features * in_features <= dense_max_elements()
