"""Tokenized windows: random calibration samples, non-overlapping evaluation windows, and the
tuning windows that defaults are chosen on.

A default picked by the perplexity of the windows it is then reported on is fitted to them, so
the benchmarks that choose defaults score the *tuning* split instead: as many windows as the
evaluation takes, cut from the other end of the held-out text. The two never share a token, and
on the stdlib corpus they come from different files (the evaluation's 64 windows of 256 tokens
cover its first few files of about 10% of the standard library)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Literal

import torch

from thresher.data.sources import Split, load_text
from thresher.errors import DataError
from thresher.recipe import CalibrationConfig, PerplexityConfig, TextSource

_TOKEN_CACHE: dict[tuple[str, str, str], torch.Tensor] = {}
CHUNK_CHARS = 1 << 20
# A line break between two non-space characters ("x\nb"): byte-level BPE pre-tokenizers split on
# both sides of it whatever the context, so cutting the text there changes no token.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def text_chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, cut only at safe line starts."""
    start = 0
    while start < len(text):
        cut = _SAFE_CUT.search(text, start + size) if start + size < len(text) else None
        end = cut.start() if cut else len(text)
        yield text[start:end]
        start = end


def tokenize_source(tokenizer, source: TextSource, split: Split) -> torch.Tensor:
    """The whole source as one 1-D tensor of token ids (memoized per tokenizer and source).

    Tokenized a megabyte at a time: one call on a whole corpus holds the tokenizer's per-token
    encodings (offsets, strings) at once, over a gigabyte for 13 MB of text, which would dwarf the
    one-layer-at-a-time memory of the calibration stages. For byte-level BPE tokenizers the ids
    equal those of the whole text (tested); a SentencePiece tokenizer may mark each piece's start.
    """
    key = (getattr(tokenizer, "name_or_path", str(id(tokenizer))), repr(source), split)
    if key not in _TOKEN_CACHE:
        parts = [
            torch.tensor(tokenizer(chunk, add_special_tokens=False, return_attention_mask=False,
                                   verbose=False)["input_ids"], dtype=torch.long)
            for chunk in text_chunks(load_text(source, split))
        ]
        _TOKEN_CACHE[key] = torch.cat(parts)
    return _TOKEN_CACHE[key]


def calibration_windows(tokenizer, cfg: CalibrationConfig) -> torch.Tensor:
    """``samples`` windows of ``seq_len`` tokens at seeded random offsets of the train text."""
    ids = tokenize_source(tokenizer, cfg.source, "train")
    if ids.numel() <= cfg.seq_len:
        raise DataError(f"calibration text has {ids.numel()} tokens, fewer than seq_len {cfg.seq_len}")
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, ids.numel() - cfg.seq_len, (cfg.samples,), generator=gen)
    return torch.stack([ids[s : s + cfg.seq_len] for s in starts.tolist()])


def eval_windows(tokenizer, cfg: PerplexityConfig) -> torch.Tensor:
    """Non-overlapping windows of the held-out text, remainder dropped (the papers' convention)."""
    ids = tokenize_source(tokenizer, cfg.source, "heldout")
    n = ids.numel() // cfg.seq_len
    if n == 0:
        raise DataError(f"evaluation text has {ids.numel()} tokens, fewer than seq_len {cfg.seq_len}")
    if cfg.max_windows is not None:
        n = min(n, cfg.max_windows)
    return ids[: n * cfg.seq_len].view(n, cfg.seq_len)


WindowSplit = Literal["eval", "tune"]


def tune_windows(tokenizer, cfg: PerplexityConfig) -> torch.Tensor:
    """The tuning split: as many windows as ``eval_windows`` takes, from the end of the held-out
    text, on the same window grid so that no token is in both. Refused when the held-out text
    is too short for the two to stay apart (or the evaluation takes all of it)."""
    ids = tokenize_source(tokenizer, cfg.source, "heldout")
    total = ids.numel() // cfg.seq_len
    n = total if cfg.max_windows is None else min(total, cfg.max_windows)
    if 2 * n > total:
        raise DataError(
            f"held-out text has {total} windows of {cfg.seq_len} tokens, too few for {n} "
            f"evaluation and {n} tuning windows that do not overlap; lower max_windows "
            f"(at most {total // 2}) or seq_len")
    start = (total - n) * cfg.seq_len
    return ids[start: start + n * cfg.seq_len].view(n, cfg.seq_len)


def perplexity_windows(tokenizer, cfg: PerplexityConfig, split: WindowSplit = "eval"
                       ) -> torch.Tensor:
    """``eval_windows`` (numbers that are reported) or ``tune_windows`` (choosing a default)."""
    if split not in ("eval", "tune"):
        raise DataError(f"window split {split!r}: choose 'eval' or 'tune'")
    return eval_windows(tokenizer, cfg) if split == "eval" else tune_windows(tokenizer, cfg)
