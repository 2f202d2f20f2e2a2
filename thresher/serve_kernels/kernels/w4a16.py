"""4-bit weight, 16-bit activation matmuls over the published GPTQ (v1) and AWQ (gemm) layouts.

The kernels dequantize a weight tile in registers right before ``tl.dot`` so the packed weight
is the only copy of the matrix ever read from memory: at decode (M <= 16) the matmul is bound by
reading those bytes, which is what 4-bit quantization buys. Decode tiles split K across programs
(fp32 atomics) so that a single row still spreads over every SM.

Layouts (K = input features, N = output features, G = group size; see shared/reference/formats.md):

- GPTQ v1: qweight int32 [K/8, N], input row 8r+j of column n at bits 4j of qweight[r, n];
  qzeros int32 [num_groups, N/8] packed along N the same way, storing zero - 1;
  scales [num_groups, N]; g_idx int32 [K] (the group of every input row; act-order makes it
  non-monotonic). W[k, n] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1)) with g = g_idx[k].
- AWQ gemm: qweight int32 [K, N/8] packed along N, nibble i of word c holding column
  8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros int32 [K/G, N/8] in the same order, the true zero;
  scales [K/G, N]. W[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n].

Both compute out = x @ W for x [..., K], accumulating in fp32, and return x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thresher.formats.awq import AWQ
from thresher.formats.gptq import GPTQ
from thresher.serve_kernels.kernels import tuning
from thresher.serve_kernels.kernels.backend import (
    DOT_PRECISION,
    TileConfig,
    dot_dtype,
    launcher,
    use_triton,
)

DECODE = TileConfig(block_m=16, block_n=64, block_k=64, split_k=4, num_warps=4, num_stages=3)
PREFILL = TileConfig(block_m=64, block_n=64, block_k=64, split_k=1, num_warps=4, num_stages=3)
CONFIGS = {"decode": DECODE, "prefill": PREFILL}
# the grouped kernel (contiguous groups): a GEMV for one row, tl.dot tiles for a few rows
GEMV = TileConfig(block_m=1, block_n=128, block_k=128, split_k=4, num_warps=4, num_stages=3)
GROUPED_DECODE = TileConfig(block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4,
                            num_stages=3)
GROUPED_PREFILL = TileConfig(block_m=64, block_n=64, block_k=128, split_k=1, num_warps=4,
                             num_stages=3)
GROUPED_CONFIGS = {"gemv": GEMV, "decode": GROUPED_DECODE, "prefill": GROUPED_PREFILL}


def grouped_config(m: int, k: int, group_size: int) -> TileConfig | None:
    """The grouped kernel's tiles for ``m`` rows, or None where it does not apply (a group size
    that no power-of-two K tile of 16..128 divides).

    Prefill-sized batches of contiguous groups take it too: it multiplies the exact codes and
    applies the scale in fp32, where the general kernel rounds each dequantized weight to the
    16-bit dot type, so decode and prefill of one weight would otherwise round it differently."""
    group = k if group_size == -1 else group_size
    block_k = next((b for b in (128, 64, 32, 16) if group % b == 0), None)
    if block_k is None:
        return None
    cfg = GEMV if m == 1 else GROUPED_DECODE if m <= 16 else GROUPED_PREFILL
    return TileConfig(cfg.block_m, cfg.block_n, block_k, cfg.split_k, cfg.num_warps,
                      cfg.num_stages)


def pick_config(m: int) -> TileConfig:
    """Decode-shaped tiles for up to 16 rows, prefill-shaped beyond."""
    return DECODE if m <= 16 else PREFILL


# ---------------------------------------------------------------- references (fp32 PyTorch)

def gptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """Dense fp32 W [K, N] from a 4-bit GPTQ v1 tensor set, as the format unpacks it."""
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    return GPTQ.dequantize(tensors, 4, -1).T


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Dense fp32 W [K, N] from an AWQ gemm tensor set (``group_size`` -1 = one group)."""
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return AWQ.dequantize(tensors, 4, group_size).T


def gptq_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
) -> torch.Tensor:
    """x @ W for a GPTQ v1 weight, in fp32."""
    return (x.float() @ gptq_dequantize(qweight, qzeros, scales, g_idx)).to(x.dtype)


def awq_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x @ W for an AWQ gemm weight, in fp32."""
    return (x.float() @ awq_dequantize(qweight, qzeros, scales, group_size)).to(x.dtype)


# ---------------------------------------------------------------- Triton kernels

@triton.jit(do_not_specialize=["M"])
def _gptq_matmul_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr,
    M, N, K,
    DOT_DTYPE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    zero_shift = (offs_n % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_kn = mask_k[:, None] & mask_n[None, :]
        a = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        packed = tl.load(qweight_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :],
                         mask=mask_kn, other=0)
        q = (packed >> ((offs_k[:, None] % 8) * 4)) & 0xF
        g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        packed_z = tl.load(qzeros_ptr + g[:, None] * (N // 8) + offs_n[None, :] // 8,
                           mask=mask_kn, other=0)
        z = ((packed_z >> zero_shift[None, :]) & 0xF) + 1
        s = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0)
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        acc += tl.dot(a.to(tl.float32).to(DOT_DTYPE), w.to(DOT_DTYPE),
                      input_precision=DOT_PRECISION)
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _awq_matmul_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr,
    M, N, K, group_size,
    DOT_DTYPE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    col = offs_n % 8
    shift = ((col // 2) + (col % 2) * 4) * 4  # nibble of column col: formats.awq.AWQ_ORDER inverted
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_kn = mask_k[:, None] & mask_n[None, :]
        a = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        packed = tl.load(qweight_ptr + offs_k[:, None] * (N // 8) + offs_n[None, :] // 8,
                         mask=mask_kn, other=0)
        q = (packed >> shift[None, :]) & 0xF
        g = offs_k // group_size
        packed_z = tl.load(qzeros_ptr + g[:, None] * (N // 8) + offs_n[None, :] // 8,
                           mask=mask_kn, other=0)
        z = (packed_z >> shift[None, :]) & 0xF
        s = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0)
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        acc += tl.dot(a.to(tl.float32).to(DOT_DTYPE), w.to(DOT_DTYPE),
                      input_precision=DOT_PRECISION)
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _grouped_matmul_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr,
    M, N, K, group_size,
    AWQ: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Contiguous groups (AWQ, GPTQ without act-order) and BLOCK_K dividing the group size: each
    K tile lies in one group, so its zeros and scales are one [BLOCK_N] row loaded once. A GPTQ
    word (8 rows of one column) is loaded once and split into its nibbles in registers; an AWQ
    word (8 columns of one row) is read by each of its columns (from L1). Splitting AWQ words in
    registers, a [BLOCK_K, BLOCK_N / 8, 8] -> [BLOCK_K, BLOCK_N] reshape, was the one AWQ-only
    step when the first H100 run (Triton 3.6) computed wrong AWQ results at group 32 for two of
    three batch sizes, which the interpreter computed right (docs/gpu.md)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # AWQ: column 8c + j sits in nibble (j // 2) + (j % 2) * 4 of word c; GPTQ: row 8r + j in
    # nibble j of word r, and its zeros (packed along N) in nibble j of word c
    col = offs_n % 8
    col_shift = (col // 2 + col % 2 * 4) * 4 if AWQ else col * 4
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * SPLIT_K):
        g = k0 // group_size
        packed_z = tl.load(qzeros_ptr + g * (N // 8) + offs_n // 8, mask=mask_n, other=0)
        z = (packed_z >> col_shift) & 0xF
        if AWQ:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            packed = tl.load(qweight_ptr + offs_k[:, None] * (N // 8) + offs_n[None, :] // 8,
                             mask=(offs_k[:, None] < K) & mask_n[None, :], other=0)
            q = (packed >> col_shift[None, :]) & 0xF
        else:
            z = z + 1  # GPTQ v1 stores zero - 1
            nib_shift = tl.arange(0, 8) * 4
            offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(qweight_ptr + offs_r[:, None] * N + offs_n[None, :],
                             mask=(offs_r[:, None] < K // 8) & mask_n[None, :], other=0)
            q = tl.reshape((packed[:, None, :] >> nib_shift[None, :, None]) & 0xF,
                           (BLOCK_K, BLOCK_N))
        s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = (q - z[None, :]).to(tl.float32)  # small integers: exact in any dot dtype
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if BLOCK_M == 1:
            a = tl.load(x_ptr + tl.program_id(0) * K + offs_k, mask=offs_k < K,
                        other=0.0).to(tl.float32)
            acc += tl.sum(a[:, None] * w, axis=0) * s
        else:
            a = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                        mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
            acc += tl.dot(a.to(tl.float32).to(DOT_DTYPE), w.to(DOT_DTYPE),
                          input_precision=DOT_PRECISION) * s[None, :]
    if BLOCK_M == 1:
        out = out_ptr + tl.program_id(0) * N + offs_n
        mask = mask_n
    else:
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def tile_candidates(default: TileConfig) -> list[TileConfig]:
    """The tiles a GPU times against ``default`` for one shape (``tuning``): column width,
    split-K and warps around it, the K tile kept (the grouped kernel's must divide the group)."""
    if default.block_m > 16:
        return tuning.variants(default, block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3))
    return tuning.variants(default, block_n=(64, 128), split_k=(2, 4, 8), num_warps=(4, 8))


def _launch(kernel, x: torch.Tensor, n: int, tensors: tuple, extra: tuple,
            config: TileConfig | None, default: TileConfig | None = None,
            **constexprs) -> torch.Tensor:
    """Launch ``kernel`` over x [..., K] -> [..., N] with ``config``, or (None) the tile
    ``tuning`` picks for the shape, starting from ``default`` (``pick_config`` if None)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    args = tuple(t.contiguous() for t in tensors)

    def run(cfg: TileConfig) -> torch.Tensor:
        out_dtype = torch.float32 if cfg.split_k > 1 else x.dtype
        out = torch.zeros if cfg.split_k > 1 else torch.empty
        y = out((m, n), device=x.device, dtype=out_dtype)
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
        launcher(kernel, x)[grid](
            x2, *args, y, m, n, k, *extra,
            DOT_DTYPE=dot_dtype(x), SPLIT_K=cfg.split_k, **cfg.launch, **constexprs,
        )
        return y

    if config is None:
        default = default or pick_config(m)
        # the K tile is part of the shape: the grouped kernel's must lie in one group, so a tile
        # chosen for group 128 must not serve a group-32 matrix of the same N and K
        key = (tuning.m_bucket(m), n, k, x.dtype, default.block_k, *constexprs.values())
        config = tuning.tuner(getattr(kernel, "fn", kernel).__name__).pick(
            key, x, default, tile_candidates(default), run)
    return run(config).to(x.dtype).reshape(*x.shape[:-1], n)


def grouped_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, awq: bool, config: TileConfig | None = None,
) -> torch.Tensor:
    """x @ W with the grouped kernel (contiguous groups only: AWQ, GPTQ without act-order)."""
    k = x.shape[-1]
    default = grouped_config(x.numel() // k, k, group_size)
    if config is None and default is None:
        raise ValueError(f"group_size={group_size}: the grouped kernel needs a group size "
                         "divisible by 16")
    n, _ = (AWQ if awq else GPTQ).matrix_shape({"qweight": qweight.shape}, 4)
    group_size = k if group_size == -1 else group_size
    return _launch(_grouped_matmul_kernel, x, n, (qweight, qzeros, scales), (group_size,), config,
                   default, AWQ=awq)


def gptq_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    g_idx: torch.Tensor, config: TileConfig | None = None, group_size: int | None = None,
) -> torch.Tensor:
    """x @ W for a GPTQ v1 weight with the Triton kernel.

    ``group_size`` says that ``g_idx`` is the contiguous ``arange(K) // group_size`` (no
    act-order): then the grouped kernel runs (each word read once, one scale row per tile),
    unless ``config`` picks a tile of the general kernel."""
    k = x.shape[-1]
    if config is None and group_size is not None and grouped_config(x.numel() // k, k,
                                                                    group_size) is not None:
        return grouped_matmul_triton(x, qweight, qzeros, scales, group_size, awq=False)
    n, _ = GPTQ.matrix_shape({"qweight": qweight.shape}, 4)
    return _launch(_gptq_matmul_kernel, x, n, (qweight, qzeros, scales, g_idx.int()), (), config)


def awq_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, config: TileConfig | None = None,
) -> torch.Tensor:
    """x @ W for an AWQ gemm weight with the Triton kernel (the grouped one where the group size
    allows)."""
    n, _ = AWQ.matrix_shape({"qweight": qweight.shape}, 4)
    if config is None and grouped_config(x.numel() // x.shape[-1], x.shape[-1],
                                         group_size) is not None:
        return grouped_matmul_triton(x, qweight, qzeros, scales, group_size, awq=True)
    group_size = x.shape[-1] if group_size == -1 else group_size
    return _launch(_awq_matmul_kernel, x, n, (qweight, qzeros, scales), (group_size,), config)


def gptq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    g_idx: torch.Tensor, group_size: int | None = None,
) -> torch.Tensor:
    """x @ W for a GPTQ v1 weight on the selected backend (see ``backend.use_triton``);
    ``group_size`` only where ``g_idx`` is contiguous (see ``gptq_matmul_triton``)."""
    if use_triton(x):
        return gptq_matmul_triton(x, qweight, qzeros, scales, g_idx, group_size=group_size)
    return gptq_matmul_ref(x, qweight, qzeros, scales, g_idx)


def awq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x @ W for an AWQ gemm weight on the selected backend (see ``backend.use_triton``)."""
    if use_triton(x):
        return awq_matmul_triton(x, qweight, qzeros, scales, group_size)
    return awq_matmul_ref(x, qweight, qzeros, scales, group_size)
