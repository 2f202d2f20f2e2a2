"""16-bit matrices in oneDNN's blocked layout on the CPU: the bf16/fp16 decode's matmul.

A 16-bit model decoding on a CPU reads every weight once per step, so the matvec's bandwidth sets
the pace. torch's ``F.linear`` on a plain row-major bf16 weight streams it at 6.6-7.6 GB/s on one
core of this machine (weights not in cache), while llama.cpp's F16 matvec reaches 8.8; the same
weight reordered once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, what
torch's inductor does to CPU linears when it freezes a model) and multiplied with
``mkldnn._linear_pointwise`` streams at 10.7 GB/s (1.2-1.5x faster at 1 and 16 rows, level at
256; ``benchmarks/engine/cpu_small_matrices.py --blocked``). The products are the same oneDNN bf16
GEMM's, bit for bit in the tests.

So on a CPU whose oneDNN runs the dtype, a 16-bit matrix of at least ``BLOCKED_MIN_ELEMENTS``
weights is reordered at load and the row-major copy released (memory stays that of the model);
``THRESHER_KERNELS=torch`` and ``dequantized()`` read it back with ``to_dense()``.
``THRESHER_CPU_BLOCKED_MIN`` (weights per matrix) overrides the threshold at load time, ``never``
turns the layout off. fp32 engines keep plain weights: there the blocked matvec was no faster.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_VAR = "THRESHER_CPU_BLOCKED_MIN"
# weights per matrix: 512 x 512 and larger ran 1.2-1.5x faster blocked at 1 and 16 rows, 8 x 1024
# and 512 x 256 level or slower (benchmarks/engine/cpu_small_matrices.py --blocked)
BLOCKED_MIN_ELEMENTS = 512 * 512
ROW_BUCKET = 32  # a prefill's rows are padded to a multiple of this (``pad_rows``)
SCRATCH_WEIGHTS = 1 << 23  # a prefill dequantizes at most this many weights at once (16 MB bf16)
_scratch = threading.local()  # per thread: ``buffers``, by dtype, that a matmul dequantizes into


def blocked_min_elements() -> int | None:
    """The threshold in force (None: never): ``THRESHER_CPU_BLOCKED_MIN`` if set."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return BLOCKED_MIN_ELEMENTS
    if value == "never":
        return None
    if not value.isdigit():
        raise ValueError(f"{ENV_VAR}={value!r}: expected a number of weights or 'never'")
    return int(value)


def blocked_supported(dtype: torch.dtype) -> bool:
    """True when this torch build's oneDNN runs ``dtype`` matmuls on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


@functools.cache
def amx_matmul() -> bool:
    """True when oneDNN runs torch's bf16 matmul on AMX tiles here: there a prefill's 4-bit,
    8-bit and NF4 weights are dequantized for it (``cpu_q4``, ``cpu_nf4``)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def serve_blocked(weight: torch.Tensor) -> bool:
    """True when a [out, in] 16-bit CPU weight should be held in the blocked layout."""
    threshold = blocked_min_elements()
    return (threshold is not None and weight.device.type == "cpu" and weight.dim() == 2
            and not weight.is_mkldnn and weight.numel() >= threshold
            and blocked_supported(weight.dtype))


@dataclass
class BlockedWeight:
    """One [N, K] 16-bit weight in oneDNN's blocked layout."""

    weight: torch.Tensor  # an mkldnn tensor
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def block(weight: torch.Tensor) -> BlockedWeight:
    """``weight`` [N, K] reordered for the decode's matvec (one-row batches)."""
    return BlockedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1),
                         weight.shape[0])


def pad_rows(x: torch.Tensor, short: bool = False) -> torch.Tensor:
    """x [M, K] with zero rows appended up to a multiple of ``ROW_BUCKET``, from that many rows
    on (with ``short``, fewer rows too). oneDNN builds a kernel for each row count it meets, 1-2
    ms each (more than a prefill's product with the matrix) and keeps 1,024 of them: with the
    counts bucketed, a server builds few per weight shape and keeps them, whatever its prompts'
    lengths. The caller takes the first M rows of the product."""
    m = x.shape[0]
    if m % ROW_BUCKET == 0 or (m < ROW_BUCKET and not short):
        return x
    return torch.cat([x, x.new_zeros(-m % ROW_BUCKET, x.shape[1])])


def dequantized_matmul(x: torch.Tensor, n: int,
                       dequantize: Callable[[int, int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W.T for a packed W [n, K] on torch's matmul (AMX tiles for bf16), in x's dtype:
    ``dequantize(n0, n1, buf)`` writes W's rows n0:n1 in that dtype into ``buf`` and returns them
    as [n1 - n0, K]. The buffer is reused per thread and dtype, and a large W goes in slices of
    output rows so that it stays within ``SCRATCH_WEIGHTS`` (a fresh 32 MB tensor per call costs
    more in first touches than the dequantizing). bf16 rows are bucketed as ``pad_rows`` says,
    fewer than ``ROW_BUCKET`` padded to it (one oneDNN kernel for them all; 16 rows more cost
    little beside the pass)."""
    m, k = x.shape
    if x.dtype == torch.bfloat16:
        x = pad_rows(x, short=True)
    rows = max(1, min(n, SCRATCH_WEIGHTS // k))
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(x.dtype)
    if buf is None or buf.numel() < rows * k:
        buf = buffers[x.dtype] = torch.empty(rows * k, dtype=x.dtype)
    if rows == n:
        return (x @ dequantize(0, n, buf).T)[:m]
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        y[:, n0:n1] = x @ dequantize(n0, n1, buf).T
    return y[:m]


def blocked_matmul(x: torch.Tensor, w: BlockedWeight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in x's dtype, which must be the weight's."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m < ROW_BUCKET:  # decode batches: as they are
        return torch.ops.mkldnn._linear_pointwise(x, w.weight, bias, "none", [], "")
    y = torch.ops.mkldnn._linear_pointwise(pad_rows(x2), w.weight, bias, "none", [], "")
    return y[:m].reshape(*x.shape[:-1], w.out_features)


def unblock(w: BlockedWeight) -> torch.Tensor:
    """The row-major weight back (the references' view of it)."""
    return w.weight.to_dense()
