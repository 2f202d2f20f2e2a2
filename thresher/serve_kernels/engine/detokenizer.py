"""Incremental detokenization and stop strings.

Decoding the whole output every step costs O(length) per token. Instead (as vLLM does) only a
short window is decoded: the text of ids[prefix_offset:read_offset] (already emitted) is
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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thresher.serve_kernels.engine.sequence import Sequence

PROMPT_CONTEXT = 5  # prompt tokens in the first window (vLLM's initial offset)


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
