"""Packing small unsigned integers into int32 words, little-endian along one dimension.

Row r of a column sits at bits [r*bits, (r+1)*bits) of that column's bit stream, cut into 32-bit
words. For 2, 4 and 8 bits this is "row 8w+j at shift 4j" (4-bit); for 3 bits a code may straddle
two words, as in AutoGPTQ's 3-bit layout. The pattern repeats every ``period`` rows, so the loops
below run over at most 32 row positions, each a strided slice of the whole tensor.
"""

from __future__ import annotations

import math

import torch

_WORD = 0xFFFFFFFF


def _period(bits: int) -> tuple[int, int]:
    """(rows, words) of one repeating packing pattern."""
    rows = 32 // math.gcd(bits, 32)
    return rows, rows * bits // 32


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, C] (each < 2^bits) -> int32 [R * bits / 32, C]."""
    rows, cols = values.shape
    p_rows, p_words = _period(bits)
    if rows % p_rows:
        raise ValueError(f"{rows} rows of {bits}-bit codes do not fill whole 32-bit words "
                         f"(need a multiple of {p_rows})")
    v = values.to(torch.int64).reshape(rows // p_rows, p_rows, cols)
    out = torch.zeros(rows // p_rows, p_words, cols, dtype=torch.int64, device=values.device)
    for j in range(p_rows):
        word, shift = divmod(j * bits, 32)
        out[:, word] |= (v[:, j] << shift) & _WORD
        if shift + bits > 32:
            out[:, word + 1] |= v[:, j] >> (32 - shift)
    return to_int32(out.reshape(-1, cols))


def unpack_along_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of ``pack_along_rows``: int32 [rows * bits / 32, C] -> int32 codes [rows, C]."""
    p_rows, p_words = _period(bits)
    cols = packed.shape[1]
    words = (packed.to(torch.int64) & _WORD).reshape(rows // p_rows, p_words, cols)
    out = torch.zeros(rows // p_rows, p_rows, cols, dtype=torch.int64, device=packed.device)
    mask = 2**bits - 1
    for j in range(p_rows):
        word, shift = divmod(j * bits, 32)
        v = words[:, word] >> shift
        if shift + bits > 32:
            v = v | (words[:, word + 1] << (32 - shift))
        out[:, j] = v & mask
    return out.reshape(rows, cols).to(torch.int32)


def pack_along_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, C] -> int32 [R, C * bits / 32], packed along columns (GPTQ qzeros)."""
    return pack_along_rows(values.T, bits).T.contiguous()


def unpack_along_cols(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    return unpack_along_rows(packed.T.contiguous(), bits, cols).T.contiguous()
