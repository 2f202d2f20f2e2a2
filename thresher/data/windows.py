"""Tokenized windows: random calibration samples and non-overlapping evaluation windows."""

from __future__ import annotations

import torch

from thresher.data.sources import Split, load_text
from thresher.errors import DataError
from thresher.recipe import CalibrationConfig, PerplexityConfig, TextSource

_TOKEN_CACHE: dict[tuple[str, str, str], torch.Tensor] = {}


def tokenize_source(tokenizer, source: TextSource, split: Split) -> torch.Tensor:
    """The whole source as one 1-D tensor of token ids (memoized per tokenizer and source)."""
    key = (getattr(tokenizer, "name_or_path", str(id(tokenizer))), repr(source), split)
    if key not in _TOKEN_CACHE:
        text = load_text(source, split)
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                        verbose=False)["input_ids"]
        _TOKEN_CACHE[key] = torch.tensor(ids, dtype=torch.long)
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
