"""Incremental detokenization and stop strings.

Decoding the whole output every step costs O(length) per token. A byte-level BPE tokenizer
(GPT-2, Llama-3, Qwen; the demo models') maps every token to fixed bytes, so ``Detokenizer``
keeps a table of each token's bytes and an incremental UTF-8 decoder per sequence: a step costs a
table lookup and the decoding of the new bytes, and a character split across tokens is emitted
when its last byte arrives. The table is checked against the tokenizer's own decoding of every
token when it is built; a tokenizer it does not fit (other decoders, space clean-up) takes the
general path. There (as vLLM does) only a short window is decoded: the text of ids[prefix_offset:read_offset] (already emitted) is
subtracted from the text of ids[prefix_offset:]. A window ending in an incomplete UTF-8
character (decoded as U+FFFD) waits for the next token. The first window starts
``PROMPT_CONTEXT`` tokens back in the prompt: SentencePiece-style decoders (Llama-2, Mistral)
drop the leading space of a text's first word, so the first generated word, decoded alone, would
lose the space that separates it from the prompt.

Stop strings: the text is searched from just before the new piece; a match cuts the text at the
stop string's start. Until a request finishes, its visible text withholds the last
``len(longest stop) - 1`` characters, which could be the beginning of a stop string, so the text a
client has seen never has to be taken back.
"""

from __future__ import annotations

import codecs
import json
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thresher.serve_kernels.engine.sequence import Sequence

PROMPT_CONTEXT = 5  # prompt tokens in the first window (vLLM's initial offset)

log = logging.getLogger(__name__)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that stands for each byte -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_level_table(tokenizer) -> list[bytes] | None:
    """Each token id's bytes (b"" for special tokens), or None where decoding is not plain
    byte-level: a fast tokenizer whose decoder is ByteLevel alone, no space clean-up, and every
    token's bytes decoding to what the tokenizer decodes it to."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    to_byte = _byte_decoder()
    special = set(tokenizer.all_special_ids)
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    table = [b"" if i in special or piece is None else
             b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode() for c in piece)
             for i, piece in enumerate(pieces)]
    decoded = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
    for i, (raw, text) in enumerate(zip(table, decoded, strict=True)):
        ours = raw.decode("utf-8", errors="replace")
        if ours != text and "\ufffd" not in ours + text:
            log.info("token %d decodes to %r, its bytes to %r: detokenizing by windows", i,
                     text, ours)
            return None
    return table


class Detokenizer:
    """Appends each sequence's newly completed text: from the byte table where the tokenizer
    has one, else by decoding windows (``append_text``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_bytes = byte_level_table(tokenizer)

    def append_text(self, seq: Sequence) -> None:
        """Extend ``seq.text`` with whatever its tokens since the last call complete."""
        if self.token_bytes is None:
            append_text(self.tokenizer, seq)
            return
        if seq.utf8 is None:
            seq.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        ids, table = seq.token_ids, self.token_bytes
        seq.text += seq.utf8.decode(b"".join([table[i] for i in ids[seq.read_offset :]]))
        seq.read_offset = len(ids)


def append_text(tokenizer, seq: Sequence) -> None:
    """Extend ``seq.text`` with whatever its newest output tokens complete."""
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)


def find_stop(seq: Sequence, new_chars: int) -> int | None:
    """Index in ``seq.text`` where one of the request's stop strings starts, if any."""
    best = None
    for stop in seq.params.stop:
        start = max(0, len(seq.text) - new_chars - len(stop) + 1)
        at = seq.text.find(stop, start)
        if at != -1 and (best is None or at < best):
            best = at
    return best


def visible_text(seq: Sequence) -> str:
    """The text a client may see now (see the module docstring)."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    hold = max(len(s) for s in seq.params.stop) - 1
    return seq.text[: len(seq.text) - hold] if hold else seq.text
