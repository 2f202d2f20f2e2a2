"""Triton kernels of the serving engine, each beside a PyTorch reference of the same math.

Every public op dispatches through ``backend.use_triton``: the Triton kernel for CUDA tensors, the
reference on a CPU, ``THRESHER_KERNELS=triton|torch`` to force either. Each module also exposes
its ``*_ref`` (fp32 PyTorch) and ``*_triton`` functions for tests and benchmarks. ``cpu_int4``
holds the CPU fast path for 4-bit GPTQ/AWQ weights converted at load time (torch's int4 kernel).
"""

from thresher.serve_kernels.kernels.activation import silu_and_mul
from thresher.serve_kernels.kernels.attention import (
    paged_decode_attention,
    paged_prefill_attention,
)
from thresher.serve_kernels.kernels.cache import store_kv_cache
from thresher.serve_kernels.kernels.moe import ExpertWeights, fused_moe, moe_align
from thresher.serve_kernels.kernels.nf4 import nf4_matmul
from thresher.serve_kernels.kernels.norm import rms_norm
from thresher.serve_kernels.kernels.rotary import apply_rotary, rotary_cos_sin
from thresher.serve_kernels.kernels.w4a16 import awq_matmul, gptq_matmul

__all__ = [
    "ExpertWeights",
    "apply_rotary",
    "awq_matmul",
    "fused_moe",
    "gptq_matmul",
    "moe_align",
    "nf4_matmul",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_cos_sin",
    "silu_and_mul",
    "store_kv_cache",
]
