"""Fused mixture-of-experts MLP: every expert's tokens in one kernel launch per projection.

A loop over experts launches one small matmul per expert and reads the routing tensors from
the host each time; at decode most experts get zero or one token. Here (token, expert) pairs are
sorted by expert and padded so each BLOCK_M-row tile belongs to a single expert (``moe_align``);
one launch then computes all tiles of a projection, each reading only its expert's weight.

Flow: gate_up = x @ W1[e].T for each pair -> silu(gate) * up -> down = act @ W2[e].T multiplied
by the pair's routing weight -> sum over the top-k pairs of each token.

Expert weights, one ``ExpertWeights`` per projection, stacked on a leading expert dim E:
- "dense": [E, N, K], the 16-bit layout transformers 5 keeps in memory
  (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).
- "gptq": GPTQ v1 per expert (see w4a16): qweight [E, K/8, N], qzeros [E, groups, N/8],
  scales [E, groups, N], g_idx [E, K].
- "awq": AWQ gemm per expert: qweight [E, K, N/8], qzeros [E, K/G, N/8], scales [E, K/G, N].
- "nf4": bitsandbytes NF4 per expert (see nf4.py): weight [E, N*K/2] uint8 (W.flat, two codes a
  byte, the first in the high nibble), scales [E, N*K/B] fp32 absmax per block of B = group_size
  elements, a shared 16-entry quant_map; K a multiple of B, so no block straddles two rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from thresher.formats.awq import AWQ
from thresher.formats.gptq import GPTQ
from thresher.formats.nf4 import NF4, NF4Weight
from thresher.formats.registry import format_for
from thresher.serve_kernels.kernels import tuning
from thresher.serve_kernels.kernels.activation import silu_and_mul_triton
from thresher.serve_kernels.kernels.backend import (
    DOT_PRECISION,
    TileConfig,
    dot_dtype,
    launcher,
    use_triton,
)

FORMATS = {"dense": 0, GPTQ.kind: 1, AWQ.kind: 2, NF4.kind: 3}  # the kernel's FORMAT constexpr
DECODE = TileConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
PREFILL = TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
CONFIGS = {"decode": DECODE, "prefill": PREFILL}


@dataclass
class ExpertWeights:
    """One projection (gate_up or down) of all experts in one of the layouts above."""

    format: str
    weight: torch.Tensor  # dense weight or packed qweight
    scales: torch.Tensor | None = None
    qzeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None  # gptq only
    group_size: int = -1  # awq: -1 = one group (gptq's groups are its g_idx); nf4: block size
    # gptq only: g_idx is arange(K) // this (no act-order; -1 for one group), known at load
    contiguous_group: int | None = None
    quant_map: torch.Tensor | None = None  # nf4 only: fp32 [16], shared by the experts
    shape: tuple[int, int] | None = None  # nf4 only: (N, K), which the flat bytes do not say

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"expert weight format {self.format!r}: expected one of {list(FORMATS)}")
        if self.format == NF4.kind and (self.quant_map is None or self.shape is None
                                        or self.shape[1] % self.group_size):
            raise ValueError("nf4 experts need a quant_map, their (N, K) shape and K a multiple "
                             f"of the block size (got shape {self.shape}, block {self.group_size})")

    def row_group(self, block_k: int) -> int | None:
        """The group size when every K tile of ``block_k`` lies in one group (contiguous groups
        that ``block_k`` divides): then a tile's zeros and scales are one row each."""
        k = self.out_in[1]
        group = {AWQ.kind: self.group_size, GPTQ.kind: self.contiguous_group,
                 NF4.kind: self.group_size}.get(self.format)
        group = k if group == -1 else group
        return group if group is not None and group % block_k == 0 else None

    @property
    def out_in(self) -> tuple[int, int]:
        """(N, K): output and input features of each expert's matrix."""
        if self.format == "dense":
            return self.weight.shape[1], self.weight.shape[2]
        if self.format == NF4.kind:
            return self.shape
        return format_for(self.format).matrix_shape({"qweight": self.weight.shape[1:]}, 4)

    def packed(self, e: int) -> dict[str, torch.Tensor]:
        """Expert ``e``'s tensors under its checkpoint format's names."""
        tensors = {"qweight": self.weight[e], "qzeros": self.qzeros[e], "scales": self.scales[e]}
        return tensors if self.g_idx is None else {**tensors, "g_idx": self.g_idx[e]}

    def matrix(self, e: int) -> torch.Tensor:
        """Expert ``e``'s [N, K] matrix: a view for 16-bit, dequantized (fp32) otherwise."""
        if self.format == "dense":
            return self.weight[e]
        if self.format == NF4.kind:
            return NF4Weight(self.weight[e], self.scales[e], self.quant_map, self.shape,
                             self.group_size).dequantize_fp32()
        return format_for(self.format).dequantize(self.packed(e), 4, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """Dense fp32 [E, N, K]."""
        return torch.stack([self.matrix(e).float() for e in range(self.weight.shape[0])])


def fused_moe_ref(
    x: torch.Tensor, w_gate_up: ExpertWeights, w_down: ExpertWeights,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The MoE MLP as a loop over experts, in fp32. x [T, H], topk_* [T, top_k] -> [T, H]."""
    w1, w2 = w_gate_up.dequantize(), w_down.dequantize()
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device, dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = (x[token].float() @ w1[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, k) pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Returns sorted_ids [P] (pair index t * top_k + k, or the sentinel T * top_k for padding) and
    expert_ids [P / block_m] (the expert of each block of ``block_m`` rows, -1 for a block past
    the last run). P is the worst case for the shape (every expert that can get a pair pads
    ``block_m - 1`` rows), so no size is read back from the device: a decode step stays free of
    host synchronisation and can be captured in a CUDA graph. The kernel skips -1 blocks.
    """
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    num_blocks = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, device=flat.device, dtype=torch.long)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would size its output on host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, device=flat.device,
                            dtype=torch.int32)
    sorted_ids[(ends - padded)[expert_of_sorted] + rank] = order.int()
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    expert_ids = torch.searchsorted(ends, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).int()
    return sorted_ids, expert_ids


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_matmul_kernel(
    a_ptr, b_ptr, scales_ptr, zeros_ptr, g_idx_ptr, quant_map_ptr, out_ptr,
    sorted_ids_ptr, expert_ids_ptr, topk_weights_ptr,
    num_pairs, N, K, group_size, pairs_per_row,
    stride_be, stride_bk, stride_bn, stride_se, stride_ze, stride_ge,
    FORMAT: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """With ``ROW_GROUPS`` (contiguous groups, BLOCK_K dividing the group size) each K tile lies
    in one group: its zeros and scales are one [BLOCK_N] row loaded once, and a GPTQ word (8 rows
    of a column) is loaded once and split in registers, as in ``w4a16._grouped_matmul_kernel``.
    Otherwise each weight gathers its group's zero and scale through g_idx (act-order). Both
    dequantize a weight by the same formula, so they compute the same tiles. NF4 (FORMAT 3)
    reads each expert's row-major bytes, looks each code up in the quant map and scales it by
    its block's absmax (``group_size`` = the block size): with ``ROW_GROUPS`` one absmax per
    column for the tile, as in ``nf4._nf4_matmul_kernel``."""
    expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:  # a worst-case block past the last expert's run: padding only
        return
    pairs = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs
    rows = (pairs // pairs_per_row).to(tl.int64)  # row of A: the token (gate_up) or the pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    b_base = b_ptr + expert * stride_be
    col = offs_n % 8
    awq_shift = ((col // 2) + (col % 2) * 4) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_kn = mask_k[:, None] & mask_n[None, :]
        a = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if FORMAT == 0:
            w = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=mask_kn, other=0.0).to(tl.float32)
        elif FORMAT == 3:
            row_start = offs_n.to(tl.int64) * K  # row n of the expert's W.flat
            byte = tl.load(b_base + row_start[None, :] // 2 + offs_k[:, None] // 2,
                           mask=mask_kn, other=0).to(tl.int32)
            code = tl.where(offs_k[:, None] % 2 == 0, byte >> 4, byte & 0xF)
            absmax = scales_ptr + expert * stride_se
            if ROW_GROUPS:
                s = tl.load(absmax + (row_start + k0) // group_size, mask=mask_n,
                            other=0.0)[None, :]
            else:
                s = tl.load(absmax + (row_start[None, :] + offs_k[:, None]) // group_size,
                            mask=mask_kn, other=0.0)
            w = tl.load(quant_map_ptr + code, mask=mask_kn, other=0.0) * s
        else:
            # codes: GPTQ packed along K (a word split in registers for row groups, else each
            # weight shifting its own), AWQ packed along N in the interleaved order
            if FORMAT == 1 and ROW_GROUPS:
                offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                packed = tl.load(b_base + offs_r[:, None] * N + offs_n[None, :],
                                 mask=(offs_r[:, None] < K // 8) & mask_n[None, :], other=0)
                q = tl.reshape((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None])
                               & 0xF, (BLOCK_K, BLOCK_N))
            elif FORMAT == 1:
                packed = tl.load(b_base + (offs_k[:, None] // 8) * N + offs_n[None, :],
                                 mask=mask_kn, other=0)
                q = (packed >> ((offs_k[:, None] % 8) * 4)) & 0xF
            else:
                packed = tl.load(b_base + offs_k[:, None] * (N // 8) + offs_n[None, :] // 8,
                                 mask=mask_kn, other=0)
                q = (packed >> awq_shift[None, :]) & 0xF
            # zeros packed along N (GPTQ stores zero - 1, AWQ the zero) and scales: one row for
            # the tile's group, or a gather per weight through its row's group
            zero_shift = col * 4 if FORMAT == 1 else awq_shift
            zero_add = 1 if FORMAT == 1 else 0
            if ROW_GROUPS:
                g = k0 // group_size
                packed_z = tl.load(zeros_ptr + expert * stride_ze + g * (N // 8) + offs_n // 8,
                                   mask=mask_n, other=0)
                z = (((packed_z >> zero_shift) & 0xF) + zero_add)[None, :]
                s = tl.load(scales_ptr + expert * stride_se + g * N + offs_n, mask=mask_n,
                            other=0.0)[None, :]
            else:
                if FORMAT == 1:
                    g = tl.load(g_idx_ptr + expert * stride_ge + offs_k, mask=mask_k, other=0)
                else:
                    g = offs_k // group_size
                packed_z = tl.load(zeros_ptr + expert * stride_ze + g[:, None] * (N // 8)
                                   + offs_n[None, :] // 8, mask=mask_kn, other=0)
                z = ((packed_z >> zero_shift[None, :]) & 0xF) + zero_add
                s = tl.load(scales_ptr + expert * stride_se + g[:, None] * N + offs_n[None, :],
                            mask=mask_kn, other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)
        acc += tl.dot(a.to(tl.float32).to(DOT_DTYPE), w.to(DOT_DTYPE),
                      input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        routed = tl.load(topk_weights_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * routed[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def moe_matmul_triton(
    a: torch.Tensor, w: ExpertWeights, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_pairs: int, pairs_per_row: int, topk_weights: torch.Tensor | None, config: TileConfig,
    row_groups: bool = True, tune: bool = True,
) -> torch.Tensor:
    """out[p] = a[p // pairs_per_row] @ W[expert of p].T (times topk_weights[p] if given);
    ``row_groups=False`` keeps the per-weight gather where a tile could load rows; with ``tune``
    a GPU may widen or narrow ``config``'s columns, warps and stages (``tuning``)."""
    n, k = w.out_in
    out = torch.empty(num_pairs, n, device=a.device, dtype=a.dtype)
    dummy = sorted_ids  # stands in for tensors a format does not use; never read
    scales = w.scales if w.scales is not None else dummy
    qzeros = w.qzeros if w.qzeros is not None else dummy
    g_idx = w.g_idx.int().contiguous() if w.g_idx is not None else dummy
    quant_map = w.quant_map.float().contiguous() if w.quant_map is not None else dummy
    weight = w.weight if w.format == "dense" else w.weight.contiguous()
    stride_bk, stride_bn = (weight.stride(2), weight.stride(1)) if w.format == "dense" else (0, 0)
    row_group = w.row_group(config.block_k) if row_groups else None
    group = row_group or (k if w.group_size == -1 else w.group_size)
    a = a.contiguous()
    scales, qzeros = scales.contiguous(), qzeros.contiguous()

    def run(cfg: TileConfig) -> torch.Tensor:
        grid = (sorted_ids.numel() // cfg.block_m, triton.cdiv(n, cfg.block_n))
        launcher(_moe_matmul_kernel, a)[grid](
            a, weight, scales, qzeros, g_idx, quant_map, out,
            sorted_ids, expert_ids, topk_weights if topk_weights is not None else dummy,
            num_pairs, n, k, group, pairs_per_row,
            weight.stride(0), stride_bk, stride_bn, scales.stride(0), qzeros.stride(0),
            g_idx.stride(0), FORMAT=FORMATS[w.format], MUL_WEIGHT=topk_weights is not None,
            DOT_DTYPE=dot_dtype(a), ROW_GROUPS=row_group is not None, **cfg.launch,
        )
        return out

    if tune:  # on a GPU, the fastest tile for the shape with the same rows (the alignment's)
        key = (tuning.m_bucket(num_pairs), n, k, a.dtype, w.format, row_group is not None,
               config.block_m, config.block_k, topk_weights is not None)
        config = tuning.tuner("_moe_matmul_kernel").pick(key, a, config, tile_candidates(config),
                                                          run)
    return run(config)


def tile_candidates(default: TileConfig) -> list[TileConfig]:
    """The tiles a GPU times for one shape (``tuning``): column width, warps and pipeline depth
    around ``default``; its rows (the alignment's block) and K tile (the group's) kept. At one
    decode token 8 experts x 24 column tiles are 1.5 programs per SM of an H100, too few loads in
    flight to stream the experts at the memory's rate, so narrower tiles are among them."""
    return tuning.variants(default, block_n=(32, 64, 128), num_warps=(4, 8),
                           num_stages=(2, 3, 4))


def fused_moe_triton(
    x: torch.Tensor, w_gate_up: ExpertWeights, w_down: ExpertWeights,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: TileConfig | None = None,
) -> torch.Tensor:
    """The MoE MLP with two kernel launches. x [T, H], topk_* [T, top_k] -> [T, H]; ``config``
    fixes the tile, else it is the decode or prefill one, tuned per shape on a GPU."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x[:, : w_down.out_in[0]])
    cfg = config or (DECODE if num_pairs <= 64 else PREFILL)
    tune = config is None
    sorted_ids, expert_ids = moe_align(topk_ids, w_gate_up.weight.shape[0], cfg.block_m)
    gate_up = moe_matmul_triton(x, w_gate_up, sorted_ids, expert_ids, num_pairs, top_k, None, cfg,
                                tune=tune)
    act = silu_and_mul_triton(gate_up)
    weights = topk_weights.float().flatten().contiguous()
    down = moe_matmul_triton(act, w_down, sorted_ids, expert_ids, num_pairs, 1, weights, cfg,
                             tune=tune)
    return down.view(tokens, top_k, -1).float().sum(dim=1).to(x.dtype)


def fused_moe(
    x: torch.Tensor, w_gate_up: ExpertWeights, w_down: ExpertWeights,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The MoE MLP on the selected backend (see ``backend.use_triton``)."""
    if use_triton(x):
        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids)
    return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids)
