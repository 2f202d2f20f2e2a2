"""NF4 dequantize-matmul over bitsandbytes' 4-bit layout, as transformers serializes it.

bitsandbytes keeps a [N, K] weight flattened in row-major order: two 4-bit codes per uint8 (the
first element in the high nibble), blocks of ``blocksize`` (64) consecutive elements sharing an
absmax, and a 16-entry code table (``quant_map``): W.flat[i] = quant_map[code_i] * absmax[i // 64].
With double quantization the absmax itself is stored as uint8 codes into ``nested_quant_map``,
scaled per 256 codes by ``nested_absmax``, plus ``nested_offset``; ``NF4Weight.absmax_fp32``
(``thresher.formats.nf4``, the one in-memory form of an NF4 matrix) undoes that once (it is 1/64
of the weight's size) so the kernel reads fp32 absmax either way.

The kernel indexes the flattened weight directly, so blocks may straddle rows and K need not be a
multiple of anything. out = x @ W.T, accumulated in fp32, in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thresher.formats.nf4 import NF4Weight
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


def tile_candidates(default: TileConfig) -> list[TileConfig]:
    """The tiles a GPU times against ``default`` for one shape (``tuning``)."""
    if default.block_m > 16:
        return tuning.variants(default, block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3))
    return tuning.variants(default, block_n=(32, 64, 128), split_k=(2, 4, 8), num_warps=(4, 8))


def nf4_dequantize(weight: NF4Weight) -> torch.Tensor:
    """Dense fp32 W [N, K], exactly as the kernel computes it (not rounded to the stored dtype)."""
    return weight.dequantize_fp32()


def nf4_matmul_ref(x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
    """x @ W.T in fp32."""
    return (x.float() @ nf4_dequantize(weight).T).to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _nf4_matmul_kernel(
    x_ptr, packed_ptr, absmax_ptr, quant_map_ptr, out_ptr,
    M, N, K,
    DOT_DTYPE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCKSIZE: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """With ``ROW_BLOCKS`` (K a multiple of the block size, so no block straddles two rows) the
    indices are a row's offset plus the column's, and a K tile inside one block reads one absmax
    per output column; otherwise each weight finds its byte and block in the flattened weight.
    The block size is a compile-time constant: a division by a runtime value per weight is a
    64-bit division, which a GPU emulates in dozens of instructions."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    row_start = offs_n.to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_kn = mask_k[:, None] & mask_n[None, :]
        a = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if ROW_BLOCKS:
            byte = tl.load(packed_ptr + row_start[None, :] // 2 + offs_k[:, None] // 2,
                           mask=mask_kn, other=0).to(tl.int32)
            code = tl.where(offs_k[:, None] % 2 == 0, byte >> 4, byte & 0xF)
            block_row = row_start // BLOCKSIZE
            if BLOCKSIZE % BLOCK_K == 0:  # the tile lies in one block of each row
                scale = tl.load(absmax_ptr + block_row + k0 // BLOCKSIZE, mask=mask_n,
                                other=0.0)[None, :]
            else:
                scale = tl.load(absmax_ptr + block_row[None, :] + offs_k[:, None] // BLOCKSIZE,
                                mask=mask_kn, other=0.0)
        else:
            flat = row_start[None, :] + offs_k[:, None]  # [BLOCK_K, BLOCK_N] index into W.flat
            byte = tl.load(packed_ptr + flat // 2, mask=mask_kn, other=0).to(tl.int32)
            code = tl.where(flat % 2 == 0, byte >> 4, byte & 0xF)
            scale = tl.load(absmax_ptr + flat // BLOCKSIZE, mask=mask_kn, other=0.0)
        value = tl.load(quant_map_ptr + code, mask=mask_kn, other=0.0)
        w = value * scale
        acc += tl.dot(a.to(tl.float32).to(DOT_DTYPE), w.to(DOT_DTYPE),
                      input_precision=DOT_PRECISION)
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def nf4_matmul_triton(
    x: torch.Tensor, weight: NF4Weight, config: TileConfig | None = None, row_blocks: bool = True
) -> torch.Tensor:
    """x @ W.T with the Triton kernel; the tile is ``config``, or per shape (``tuning``);
    ``row_blocks=False`` keeps the flattened indexing where rows hold whole blocks."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    packed, absmax = weight.packed.contiguous(), weight.absmax_fp32().contiguous()
    quant_map = weight.quant_map.float().contiguous()

    def run(cfg: TileConfig) -> torch.Tensor:
        if cfg.split_k > 1:
            y = torch.zeros(m, n, device=x.device, dtype=torch.float32)
        else:
            y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
        launcher(_nf4_matmul_kernel, x)[grid](
            x2, packed, absmax, quant_map, y, m, n, k,
            DOT_DTYPE=dot_dtype(x), SPLIT_K=cfg.split_k, BLOCKSIZE=weight.blocksize,
            ROW_BLOCKS=row_blocks and k % weight.blocksize == 0, **cfg.launch,
        )
        return y

    if config is None:
        default = DECODE if m <= 16 else PREFILL
        config = tuning.tuner("_nf4_matmul_kernel").pick(
            (tuning.m_bucket(m), n, k, x.dtype), x, default, tile_candidates(default), run)
    return run(config).to(x.dtype).reshape(*x.shape[:-1], n)


def nf4_matmul(x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
    """x @ W.T on the selected backend (see ``backend.use_triton``)."""
    if use_triton(x):
        return nf4_matmul_triton(x, weight)
    return nf4_matmul_ref(x, weight)
