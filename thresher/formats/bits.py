"""Packing small unsigned integers into int32 words, little-endian along one dimension.

Row r of a column sits at bits [r*bits, (r+1)*bits) of that column's bit stream, cut into 32-bit
words. For 2, 4 and 8 bits this is "row 8w+j at shift 4j" (4-bit); for 3 bits a code may straddle
two words, as in AutoGPTQ's 3-bit layout. The pattern repeats every ``period`` rows. The work is
done along the last dimension, where a period's codes are adjacent (``pack_last``); packing along
rows transposes the codes (bytes) first and the words back, which is what a GPTQ writer needs:
its codes are [N, K] and its qweight packs along K.
"""

from __future__ import annotations

import math
import sys

import torch

_WORD = 0xFFFFFFFF


def _period(bits: int) -> tuple[int, int]:
    """(rows, words) of one repeating packing pattern."""
    rows = 32 // math.gcd(bits, 32)
    return rows, rows * bits // 32


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _bytes_pack(bits: int) -> bool:
    """2, 4 and 8 bits fill whole bytes, and on a little-endian machine four bytes viewed as an
    int32 are the word: byte b holds bits [8b, 8b + 8)."""
    return 8 % bits == 0 and sys.byteorder == "little"


def pack_last(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
              ) -> torch.Tensor:
    """Codes [..., L] (each < 2^bits) -> int32 [..., L * bits / 32], packed along the last
    dimension. ``order`` (one period's positions, 32 // bits of them): code ``order[i]`` of each
    period goes to slot i (AWQ's interleaving); None keeps the natural order.

    Along the last dimension a period's codes are adjacent. For 2, 4 and 8 bits the codes are
    combined into bytes and the bytes viewed as words, so no temporary is wider than the codes
    (a writer packs hundreds of matrices a layer; 64-bit temporaries made it memory-bound)."""
    *lead, length = values.shape
    p_rows, p_words = _period(bits)
    if length % p_rows:
        raise ValueError(f"{length} {bits}-bit codes do not fill whole 32-bit words "
                         f"(need a multiple of {p_rows})")
    if _bytes_pack(bits):
        v = values.to(torch.uint8).reshape(*lead, length // p_rows, p_rows)
        slot = order or range(p_rows)  # slot i of a word holds code slot[i] of its period
        per_byte = 8 // bits
        word_bytes = []
        for b in range(4):
            byte = v[..., slot[b * per_byte]].clone()
            for j in range(1, per_byte):
                byte |= v[..., slot[b * per_byte + j]] << (j * bits)
            word_bytes.append(byte)
        return torch.stack(word_bytes, dim=-1).view(torch.int32).reshape(*lead, -1)
    v = values.to(torch.int64).reshape(*lead, length // p_rows, p_rows)
    if order is not None:
        v = v[..., list(order)]
    out = torch.zeros(*v.shape[:-1], p_words, dtype=torch.int64, device=values.device)
    for j in range(p_rows):  # 3 bits: a code may straddle two words
        word, shift = divmod(j * bits, 32)
        out[..., word] |= (v[..., j] << shift) & _WORD
        if shift + bits > 32:
            out[..., word + 1] |= v[..., j] >> (32 - shift)
    return to_int32(out).reshape(*lead, -1)


def unpack_last(packed: torch.Tensor, bits: int, length: int,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of ``pack_last``: int32 [..., length * bits / 32] -> int32 codes [..., length]."""
    *lead, _ = packed.shape
    p_rows, p_words = _period(bits)
    mask = 2**bits - 1
    if _bytes_pack(bits):
        # flat first: a size-1 dimension may keep any stride, which ``view`` refuses
        raw = packed.to(torch.int32).contiguous().reshape(-1).view(torch.uint8)
        raw = raw.reshape(*lead, -1)
        codes = torch.stack([(raw >> (j * bits)) & mask for j in range(8 // bits)], dim=-1)
        codes = codes.reshape(*lead, length // p_rows, p_rows)
    else:
        words = (packed.to(torch.int64) & _WORD).reshape(*lead, length // p_rows, p_words)
        codes = torch.empty(*words.shape[:-1], p_rows, dtype=torch.int64, device=packed.device)
        for j in range(p_rows):
            word, shift = divmod(j * bits, 32)
            c = words[..., word] >> shift
            if shift + bits > 32:
                c = c | (words[..., word + 1] << (32 - shift))
            codes[..., j] = c & mask
    if order is not None:
        codes = codes[..., [order.index(i) for i in range(p_rows)]]
    return codes.reshape(*lead, length).to(torch.int32)


def pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, C] (each < 2^bits) -> int32 [R * bits / 32, C]."""
    return pack_last(values.T, bits).T.contiguous()


def unpack_along_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of ``pack_along_rows``: int32 [rows * bits / 32, C] -> int32 codes [rows, C]."""
    return unpack_last(packed.T, bits, rows).T.contiguous()


def pack_along_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, C] -> int32 [R, C * bits / 32], packed along columns (GPTQ qzeros)."""
    return pack_last(values, bits)


def unpack_along_cols(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    return unpack_last(packed, bits, cols)
