"""Incremental detokenization and stop strings.

Decoding the whole output every step costs O(length) per token. Instead (as vLLM does) only a
short window is decoded: the text of ids[prefix_offset:read_offset] (already emitted) is
subtracted from the text of ids[prefix_offset:]. A window ending in an incomplete UTF-8
character (decoded as U+FFFD) waits for the next token.

Stop strings: the text is searched from just before the new piece; a match cuts the text at the
stop string's start. Until a request finishes, its visible text withholds the last
``len(longest stop) - 1`` characters, which could be the beginning of a stop string, so the text a
client has seen never has to be taken back.
"""

from __future__ import annotations

from thresher.serve_kernels.engine.sequence import Sequence


def append_text(tokenizer, seq: Sequence) -> None:
    """Extend ``seq.text`` with whatever its newest output tokens complete."""
    ids = seq.output_token_ids
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
