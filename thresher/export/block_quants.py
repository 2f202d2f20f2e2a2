"""The ggml block quantizers the gguf package lacks: Q3_K, Q4_K, Q5_K and Q6_K, and the
importance-weighted (``--imatrix``) Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0 and Q5_1.

The gguf package quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 by plain rounding and only dequantizes
the K-quants. These quantizers make the same search llama.cpp's do (ggml-quants.c): a symmetric grid
whose scale is fitted by weighted least squares over a sweep of trial scales (``_symmetric``,
llama.cpp's make_qx_quants), an asymmetric grid whose scale and minimum are fitted the same way
(``_asymmetric``, make_qkx2/qkx3_quants), Q3_K's plain search that moves one code at a time
(``_symmetric_descent``, make_q3_quants), and the 6-bit sub-block scales of Q4_K and Q5_K fitted
to their super-block scale with a coordinate descent (``_scales``, make_qp_quants). Each runs on every
block of a tensor at once in float32 numpy, and the bytes are laid out as ggml's block structs,
so ``gguf.quants.dequantize`` and llama.cpp read them.

The importance of column j is llama.cpp's imatrix value: the mean of x_j^2 over the calibration
tokens that reach the weight. The weighted search minimizes sum_j imp_j * (w_j - q_j)^2 per block,
which is the layer's output error on that data when the inputs' columns are uncorrelated.
"""

from __future__ import annotations

import gguf
import numpy as np

F32 = np.float32
QK_K = 256
_EPS = F32(1e-15)
_CHUNK_BLOCKS = 1 << 15  # blocks of 32 handled per numpy pass: bounds the temporaries' memory

QType = gguf.GGMLQuantizationType
THRESHER_QUANTIZED = frozenset({QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K})  # never by gguf
IMPORTANCE_WEIGHTED = frozenset({QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q4_0,
                                 QType.Q4_1, QType.Q5_0, QType.Q5_1})


def quantize(weights: np.ndarray, qtype: QType, importance: np.ndarray | None = None) -> np.ndarray:
    """``weights`` [..., C] as ``qtype`` blocks, [..., bytes per row] uint8 (gguf's byte shape).

    ``importance`` [C] (one value per input column, shared by every row) selects the weighted
    search; without it the K-quants use llama.cpp's plain search and the rest gguf's rounding."""
    if importance is None and qtype not in THRESHER_QUANTIZED:
        return gguf.quants.quantize(weights, qtype)
    if importance is not None and qtype not in IMPORTANCE_WEIGHTED:
        raise ValueError(f"{qtype.name} has no importance-weighted quantizer")
    cols = weights.shape[-1]
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"rows of {cols} values are not a multiple of the {qtype.name} block")
    if importance is not None and importance.shape != (cols,):
        raise ValueError(f"importance has shape {importance.shape}, expected ({cols},)")
    rows = weights.reshape(-1, cols).astype(F32, copy=False)
    out = np.empty((rows.shape[0], cols // block * type_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_BLOCKS * 32 // cols)
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        out[start:start + step] = _QUANTIZERS[qtype](chunk, importance).reshape(chunk.shape[0], -1)
    return out.reshape(*weights.shape[:-1], -1)


# --- the searches, each over N blocks at once ---------------------------------------------------


def _nearest(v: np.ndarray) -> np.ndarray:
    """Round half to even, as ggml's nearest_int does in the FPU's default mode."""
    return np.rint(v).astype(np.int32)


def _safe(v: np.ndarray, ok: np.ndarray) -> np.ndarray:
    return np.where(ok, v, F32(1))


def _symmetric(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale and codes (0..2*nmax-1, value = scale*(code - nmax)) of blocks x [N, n] minimizing
    sum w*(x - scale*q)^2 over 19 trial grids anchored at the block's largest |x|."""
    idx = np.abs(x).argmax(axis=1)
    peak = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    live = np.abs(peak) >= _EPS
    peak = _safe(peak, live)

    def grid(iscale):
        return np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)

    def fit(q):
        qf = q.astype(F32)
        return (w * x * qf).sum(axis=1), (w * qf * qf).sum(axis=1)

    codes = grid(F32(-nmax) / peak)
    sumlx, suml2 = fit(codes)
    scale = np.where(suml2 > 0, sumlx / _safe(suml2, suml2 > 0), F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        trial = grid(-(F32(nmax) + F32(0.1) * F32(step)) / peak)
        slx, sl2 = fit(trial)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        codes = np.where(better[:, None], trial, codes)
        scale = np.where(better, slx / _safe(sl2, sl2 > 0), scale)
        best = np.where(better, scale * slx, best)
    return np.where(live, scale, F32(0)), np.where(live[:, None], codes + nmax, 0)


def _symmetric_descent(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale and codes (0..2*nmax-1) of blocks x [N, n] as make_q3_quants finds them without an
    importance matrix: the grid at the block's largest |x|, then up to 5 rounds that move single
    codes while that raises the x^2-weighted fit (sumlx^2 / suml2)."""
    idx = np.abs(x).argmax(axis=1)
    peak = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    live = np.abs(peak) >= _EPS
    codes = np.clip(_nearest((F32(-nmax) / _safe(peak, live))[:, None] * x), -nmax, nmax - 1)
    sumlx, suml2 = _descend(x, x * x, codes, -nmax, nmax - 1, positive_before=False)
    scale = np.where(live & (suml2 > 0), sumlx / _safe(suml2, suml2 > 0), F32(0))
    return scale, np.where(live[:, None], codes + nmax, 0)


def _descend(x: np.ndarray, w: np.ndarray, codes: np.ndarray, lo: int, hi: int,
              positive_before: bool) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's coordinate descent on a block's codes (in place): up to 5 rounds that move one
    code at a time to the value that best fits with the others fixed, kept while it raises the
    weighted fit sumlx^2 / suml2; returns sumlx and suml2 of the final codes. The two llama.cpp
    loops differ only in where they require sl2 > 0: before the move (make_qp_quants,
    ``positive_before``) or after it (make_q3_quants)."""
    qf = codes.astype(F32)
    sumlx, suml2 = (w * x * qf).sum(axis=1), (w * qf * qf).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(5):  # a block that changed nothing stays put, so all run every round
            for i in range(x.shape[1]):
                wi, xi, li = w[:, i], x[:, i], codes[:, i].astype(F32)
                slx, sl2 = sumlx - wi * xi * li, suml2 - wi * li * li
                ok = (slx > 0) & (sl2 > 0) if positive_before else slx > 0
                new = np.clip(_nearest(np.nan_to_num(xi * sl2 / _safe(slx, ok))), lo, hi)
                nf = new.astype(F32)
                slx, sl2 = slx + wi * xi * nf, sl2 + wi * nf * nf
                accept = ok & (new != codes[:, i]) & (slx * slx * suml2 > sumlx * sumlx * sl2)
                if not positive_before:
                    accept &= sl2 > 0
                codes[:, i] = np.where(accept, new, codes[:, i])
                sumlx, suml2 = np.where(accept, slx, sumlx), np.where(accept, sl2, suml2)
    return sumlx, suml2


def _asymmetric(x: np.ndarray, nmax: int, w: np.ndarray, rmin: float, rdelta: float, nstep: int,
                clamp_to_range: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale, minimum (value = scale*q + minimum, minimum <= 0) and codes 0..nmax of blocks
    x [N, n], fitted by weighted least squares on nstep+1 trial grids between the block's min and
    max. ``clamp_to_range`` is make_qkx3's guard against a fitted minimum above the block."""
    lo = np.minimum(x.min(axis=1), F32(0))
    hi = x.max(axis=1)
    live = hi > lo
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)
    iscale = F32(nmax) / _safe(hi - lo, live)
    scale = F32(1) / iscale
    codes = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    diff = scale[:, None] * codes + lo[:, None] - x
    best = (w * diff * diff).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for step in range(nstep + 1):
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / _safe(hi - lo, live)
            v = iscale[:, None] * (x - lo[:, None])
            if clamp_to_range:
                trial = np.where(v > 0, _nearest(np.minimum(v, F32(nmax))), 0)
            else:
                trial = np.clip(_nearest(np.nan_to_num(v)), 0, nmax)
            qf = trial.astype(F32)
            sum_l, sum_l2, sum_xl = (w * qf).sum(axis=1), (w * qf * qf).sum(axis=1), \
                (w * qf * x).sum(axis=1)
            det = sum_w * sum_l2 - sum_l * sum_l
            ok = live & (det > 0)
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / _safe(det, ok)
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / _safe(det, ok)
            above = this_min > 0
            this_min = np.where(above, F32(0), this_min)
            this_scale = np.where(above, sum_xl / _safe(sum_l2, sum_l2 > 0), this_scale)
            diff = this_scale[:, None] * qf + this_min[:, None] - x
            better = ok & ((w * diff * diff).sum(axis=1) < best)
            best = np.where(better, (w * diff * diff).sum(axis=1), best)
            codes = np.where(better[:, None], trial, codes)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    return (np.where(live, scale, F32(0)), lo, np.where(live[:, None], codes, 0))


def _scales(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Super-block scale and codes 0..nmax of non-negative values x [N, n] (Q4_K's sub-block
    scales or minimums, weighted by the sub-blocks' total importance w)."""
    peak = np.maximum(x.max(axis=1), F32(0))
    live = peak >= _EPS
    peak = _safe(peak, live)

    def mse(iscale, clip):
        q = _nearest(iscale[:, None] * x)
        q = np.minimum(q, nmax) if clip else q
        diff = x - (F32(1) / iscale)[:, None] * q
        return (w * diff * diff).sum(axis=1)

    iscale = F32(nmax) / peak
    best = mse(iscale, clip=False)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial = (F32(0.1) * F32(step) + F32(nmax)) / peak
        err = mse(trial, clip=True)
        iscale = np.where(err < best, trial, iscale)
        best = np.minimum(err, best)
    codes = np.clip(_nearest(iscale[:, None] * x), 0, nmax)
    sumlx, suml2 = _descend(x, w, codes, 0, nmax, positive_before=True)
    scale = np.where(suml2 > 0, sumlx / _safe(suml2, suml2 > 0), F32(0))
    return np.where(live, scale, F32(0)), np.where(live[:, None], codes, 0)


# --- the formats ---------------------------------------------------------------------------------


def _half_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(v.shape[0], 2)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes [N, 2, 32] (or [N, k, 2, 32]) as bytes: the first half in the low nibbles."""
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).astype(np.uint8)


def _pack_q5_0(codes: np.ndarray) -> np.ndarray:
    """Codes [N, 32] (0..31) as Q5_0's 4 high-bit bytes and 16 nibble bytes."""
    high = np.packbits((codes >> 4).astype(np.uint8), axis=1, bitorder="little")
    return np.concatenate([high, _nibbles((codes & 0xF).reshape(-1, 2, 16))], axis=1)


def _pack_q3_k(codes: np.ndarray) -> np.ndarray:
    """Codes [n, 256] (0..7) as Q3_K's 32-byte high-bit mask and 64 bytes of low 2 bits."""
    n = codes.shape[0]
    codes = codes.reshape(n, 8, 32)
    hmask = sum((codes[:, b] >> 2 & 1) << b for b in range(8)).astype(np.uint8)
    low = (codes & 3).reshape(n, 2, 4, 32)
    qs = sum(low[:, :, k] << (2 * k) for k in range(4)).astype(np.uint8).reshape(n, 64)
    return np.concatenate([hmask, qs], axis=1)


def _pack_q4_k(codes: np.ndarray) -> np.ndarray:
    """Codes [n, 256] (0..15) as Q4_K's 128 nibble bytes."""
    n = codes.shape[0]
    return _nibbles(codes.reshape(n, 4, 2, 32)).reshape(n, 128)


def _pack_q5_k(codes: np.ndarray) -> np.ndarray:
    """Codes [n, 256] (0..31) as Q5_K's 32-byte high-bit mask (bits 2k and 2k+1 for the two
    halves of the k-th 64 values) and 128 nibble bytes."""
    n = codes.shape[0]
    halves = codes.reshape(n, 4, 2, 32)
    qh = sum(((halves[:, k, h] >> 4) & 1) << (2 * k + h) for k in range(4) for h in range(2))
    return np.concatenate([qh.astype(np.uint8), _pack_q4_k(codes & 0xF)], axis=1)


def _pack_q6_k(codes: np.ndarray) -> np.ndarray:
    """Codes [n, 256] (0..63) as Q6_K's 128 bytes of low 4 bits and 64 of high 2 bits."""
    n = codes.shape[0]
    codes = codes.reshape(n, 2, 4, 32).astype(np.uint8)
    low = codes & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
                        axis=2).reshape(n, 128)
    high = codes >> 4
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6))
    return np.concatenate([ql, qh.reshape(n, 64)], axis=1)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    return _nibbles(codes.reshape(-1, 2, 16))


# Where each type keeps its codes in a block's bytes, how to pack them, and their range
# (code q stands for the integer q - offset on the block's grid).
_CODES: dict[QType, tuple[slice, object, int, int]] = {
    QType.Q4_0: (slice(2, 18), _pack_nibbles, 16, 8),
    QType.Q4_1: (slice(4, 20), _pack_nibbles, 16, 0),
    QType.Q5_0: (slice(2, 22), _pack_q5_0, 32, 16),
    QType.Q3_K: (slice(0, 96), _pack_q3_k, 8, 4),
    QType.Q4_K: (slice(16, 144), _pack_q4_k, 16, 0),
    QType.Q6_K: (slice(0, 192), _pack_q6_k, 64, 32),
}
REPLACEABLE_CODES = frozenset(_CODES)


def code_range(qtype: QType) -> tuple[int, int]:
    """Number of codes and the offset: code q stands for q - offset times the element's step."""
    _, _, levels, offset = _CODES[qtype]
    return levels, offset


def replace_codes(blocks: np.ndarray, qtype: QType, codes: np.ndarray) -> np.ndarray:
    """``blocks`` [N, type bytes] of ``qtype`` with their codes replaced by ``codes`` [N, block]
    (0..levels-1) and their scales (and minimums) kept: how a rounding other than the fit's own,
    GPTQ's, is written into the fitted blocks."""
    where, pack, levels, _ = _CODES[qtype]
    if codes.min() < 0 or codes.max() >= levels:
        raise ValueError(f"{qtype.name} codes must lie in 0..{levels - 1}")
    out = blocks.copy()
    out[:, where] = pack(codes.astype(np.int32))
    return out


def _row_weights(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """llama.cpp's per-value weight for the 32-blocks: imp_j * sqrt(sigma^2 + x_j^2), sigma^2
    the row's mean square."""
    sigma2 = (rows * rows).mean(axis=1, dtype=F32)
    return importance.astype(F32)[None, :] * np.sqrt(sigma2[:, None] + rows * rows)


def _q4_0(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    w = _row_weights(rows, importance).reshape(-1, 32)
    d, codes = _symmetric(rows.reshape(-1, 32), 8, w)
    return np.concatenate([_half_bytes(d), _pack_nibbles(codes)], axis=1)


def _q4_1(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    w = _row_weights(rows, importance).reshape(-1, 32)
    d, lo, codes = _asymmetric(rows.reshape(-1, 32), 15, w, -0.9, 0.05, 36, clamp_to_range=True)
    return np.concatenate([_half_bytes(d), _half_bytes(lo), _pack_nibbles(codes)], axis=1)


def _q5_1(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    w = _row_weights(rows, importance).reshape(-1, 32)
    d, lo, codes = _asymmetric(rows.reshape(-1, 32), 31, w, -0.9, 0.05, 36, clamp_to_range=True)
    return np.concatenate([_half_bytes(d), _half_bytes(lo), _pack_q5_0(codes)], axis=1)


def _q5_0(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    w = _row_weights(rows, importance).reshape(-1, 32)
    d, codes = _symmetric(rows.reshape(-1, 32), 16, w)
    return np.concatenate([_half_bytes(d), _pack_q5_0(codes)], axis=1)


def _q3_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """110-byte super-blocks of 256: high-bit mask, low 2 bits, 16 6-bit scales, fp16 d;
    value = d*(sc - 32)*(q - 4). Plain: llama.cpp's quantize_row_q3_K_ref (the block scale from the
    largest sub-block scale); weighted: quantize_row_q3_K_impl (both levels fitted by weighted
    least squares)."""
    x = rows.reshape(-1, 16, 16)
    n = x.shape[0]
    if importance is None:
        scales, codes = _symmetric_descent(x.reshape(-1, 16), 4)
        scales = scales.reshape(n, 16)
        idx = np.abs(scales).argmax(axis=1)
        top = np.take_along_axis(scales, idx[:, None], axis=1)[:, 0]
        live = top != 0
        iscale = F32(-32) / _safe(top, live)
        ls = np.where(live[:, None], np.clip(_nearest(iscale[:, None] * scales), -32, 31) + 32, 0)
        d16 = np.where(live, F32(1) / iscale, F32(0)).astype(np.float16)
    else:
        sigma2 = F32(2) * (x * x).sum(axis=(1, 2)) / F32(QK_K)
        imp = np.tile(importance.astype(F32).reshape(-1, 16, 16), (rows.shape[0], 1, 1))
        w = imp * np.sqrt(sigma2[:, None, None] + x * x)
        scales, codes = _symmetric(x.reshape(-1, 16), 4, w.reshape(-1, 16))
        d, ls = _symmetric(scales.reshape(n, 16), 32, w.sum(axis=2))
        d16 = d.astype(np.float16)
    sub_d = d16.astype(F32)[:, None] * (ls - 32)
    ok = sub_d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest(x / _safe(sub_d, ok)[..., None]), -4, 3) + 4
    codes = np.where(ok[..., None], requant, codes.reshape(n, 16, 16)).reshape(n, 256)
    packed = np.empty((n, 12), dtype=np.uint8)
    packed[:, :8] = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    high = (ls >> 4).reshape(n, 4, 4)  # [quarter, r]: scale 4*quarter + r
    packed[:, 8:] = sum(high[:, q] << (2 * q) for q in range(4))
    return np.concatenate([_pack_q3_k(codes), packed, _half_bytes(d16)], axis=1)


def _k_asymmetric(rows: np.ndarray, importance: np.ndarray | None, nmax: int,
                  plain: tuple[float, float, int]) -> tuple[np.ndarray, np.ndarray]:
    """The super-blocks of 256 Q4_K and Q5_K share: fp16 d and dmin, then 8 sub-blocks of 32 with
    6-bit scales and minimums (12 bytes), codes 0..nmax; value = d*sc*q - dmin*m. Returns the
    32-byte header (d, dmin, scales) and the codes [n, 256]. ``plain`` is the unweighted search's
    (rmin, rdelta, nstep), llama.cpp's make_qkx2_quants arguments for the type."""
    x = rows.reshape(-1, 8, 32)
    n = x.shape[0]
    if importance is None:
        spread = np.sqrt((x * x).sum(axis=2) / F32(32))
        w = spread[..., None] + np.abs(x)
        scales, mins, codes = _asymmetric(x.reshape(-1, 32), nmax, w.reshape(-1, 32), *plain,
                                          clamp_to_range=False)
        scales, mins = scales.reshape(n, 8), -mins.reshape(n, 8)
        top_scale = np.maximum(scales.max(axis=1), F32(0))
        top_min = np.maximum(mins.max(axis=1), F32(0))
        inv_scale = np.where(top_scale > 0, F32(63) / _safe(top_scale, top_scale > 0), F32(0))
        inv_min = np.where(top_min > 0, F32(63) / _safe(top_min, top_min > 0), F32(0))
        ls = np.clip(_nearest(inv_scale[:, None] * scales), 0, 63)
        lm = np.clip(_nearest(inv_min[:, None] * mins), 0, 63)
        d, dmin = top_scale / F32(63), top_min / F32(63)
    else:
        sigma2 = F32(2) * (x * x).sum(axis=(1, 2)) / F32(QK_K)
        imp = np.tile(importance.astype(F32).reshape(-1, 8, 32), (rows.shape[0], 1, 1))
        w = imp * np.sqrt(sigma2[:, None, None] + x * x)
        scales, mins, codes = _asymmetric(x.reshape(-1, 32), nmax, w.reshape(-1, 32), -0.9, 0.05,
                                          36, clamp_to_range=True)
        scales, mins = scales.reshape(n, 8), -mins.reshape(n, 8)
        d, ls = _scales(scales, 63, w.sum(axis=2))
        dmin, lm = _scales(mins, 63, w.sum(axis=2))
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sub_d = d16.astype(F32)[:, None] * ls
    sub_m = dmin16.astype(F32)[:, None] * lm
    ok = sub_d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest((x + sub_m[..., None]) / _safe(sub_d, ok)[..., None]), 0, nmax)
    codes = np.where(ok[..., None], requant, codes.reshape(n, 8, 32))
    packed = np.empty((n, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    header = np.concatenate([_half_bytes(d16), _half_bytes(dmin16), packed], axis=1)
    return header, codes.reshape(n, 256)


def _q4_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """144-byte super-blocks of 256: the shared header, then 4-bit codes."""
    header, codes = _k_asymmetric(rows, importance, 15, (-1.0, 0.1, 20))
    return np.concatenate([header, _pack_q4_k(codes)], axis=1)


def _q5_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """176-byte super-blocks of 256: the shared header, a 32-byte high-bit mask, then the low 4
    bits as Q4_K lays them out. llama.cpp's Q4_K_S and Q3_K_M give it to attn_v, attn_output and
    the first ffn_down layers."""
    header, codes = _k_asymmetric(rows, importance, 31, (-0.5, 0.1, 15))
    return np.concatenate([header, _pack_q5_k(codes)], axis=1)


def _q6_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """210-byte super-blocks of 256: low 4 bits, high 2 bits, 16 int8 scales, fp16 d;
    value = d*sc*(q - 32)."""
    x = rows.reshape(-1, 16, 16)
    n = x.shape[0]
    if importance is None:
        w = x * x
    else:
        w = np.tile(importance.astype(F32).reshape(-1, 16, 16), (rows.shape[0], 1, 1))
    scales, codes = _symmetric(x.reshape(-1, 16), 32, w.reshape(-1, 16))
    scales = scales.reshape(n, 16)
    idx = np.abs(scales).argmax(axis=1)
    top = np.take_along_axis(scales, idx[:, None], axis=1)[:, 0]
    live = np.abs(top) >= _EPS
    iscale = F32(-128) / _safe(top, live)
    d16 = np.where(live, F32(1) / iscale, F32(0)).astype(np.float16)
    sc = np.where(live[:, None], np.minimum(127, _nearest(iscale[:, None] * scales)), 0)
    sub_d = d16.astype(F32)[:, None] * sc
    ok = sub_d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest(x / _safe(sub_d, ok)[..., None]), -32, 31) + 32
    codes = np.where(ok[..., None], requant, codes.reshape(n, 16, 16))
    codes = np.where(live[:, None, None], codes, 0).reshape(n, 256)
    return np.concatenate([_pack_q6_k(codes), sc.astype(np.int8).view(np.uint8),
                           _half_bytes(d16)], axis=1)


_QUANTIZERS = {QType.Q3_K: _q3_k, QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k,
               QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1}
