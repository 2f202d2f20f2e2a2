"""Tokenizing a corpus in chunks gives the ids of tokenizing it whole, at bounded memory."""

import pytest
import torch

from thresher.data.sources import load_text
from thresher.data.windows import (
    eval_windows,
    perplexity_windows,
    text_chunks,
    tokenize_source,
    tune_windows,
)
from thresher.errors import DataError
from thresher.recipe import FilesSource, PerplexityConfig


def test_chunks_cover_the_text_and_cut_only_between_non_space_lines():
    text = load_text("stdlib", "heldout")
    chunks = list(text_chunks(text, size=20_000))
    assert len(chunks) > 5 and "".join(chunks) == text
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.endswith("\n") and not a[-2].isspace() and not b[0].isspace()


def test_chunked_ids_equal_whole_text_ids(tiny_tokenizer):
    text = load_text("stdlib", "heldout")[:300_000]
    whole = tiny_tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    parts = [tiny_tokenizer(c, add_special_tokens=False, verbose=False)["input_ids"]
             for c in text_chunks(text, size=10_000)]
    assert torch.equal(torch.tensor(whole), torch.tensor([i for p in parts for i in p]))


def test_tuning_windows_are_disjoint_from_the_evaluation_windows(tiny_tokenizer):
    """The tuning split takes as many windows as the evaluation, from the other end of the
    held-out text on the same grid: no token position is in both, and no window repeats."""
    cfg = PerplexityConfig(max_windows=64)
    ids = tokenize_source(tiny_tokenizer, cfg.source, "heldout")
    evaluation, tune = eval_windows(tiny_tokenizer, cfg), tune_windows(tiny_tokenizer, cfg)
    assert evaluation.shape == tune.shape == (64, cfg.seq_len)
    total = ids.numel() // cfg.seq_len
    tune_start = (total - 64) * cfg.seq_len
    assert tune_start >= 64 * cfg.seq_len  # past the last evaluation token
    assert torch.equal(tune.reshape(-1), ids[tune_start: tune_start + tune.numel()])
    assert torch.equal(evaluation.reshape(-1), ids[: evaluation.numel()])
    assert not {tuple(w) for w in evaluation.tolist()} & {tuple(w) for w in tune.tolist()}
    assert torch.equal(perplexity_windows(tiny_tokenizer, cfg, "tune"), tune)
    assert torch.equal(perplexity_windows(tiny_tokenizer, cfg, "eval"), evaluation)


def test_tuning_split_refuses_a_text_too_short_for_both(tiny_tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    source = FilesSource(files=[str(tmp_path / "a.txt")])
    total = tokenize_source(tiny_tokenizer, source, "heldout").numel() // 32
    assert tune_windows(tiny_tokenizer, PerplexityConfig(source=source, seq_len=32,
                                                         max_windows=total // 2)).shape[0] > 0
    with pytest.raises(DataError, match=rf"{total} windows of 32 tokens, too few for .* lower "
                                        rf"max_windows \(at most {total // 2}\)"):
        tune_windows(tiny_tokenizer, PerplexityConfig(source=source, seq_len=32,
                                                      max_windows=total // 2 + 1))
    with pytest.raises(DataError, match="too few"):  # the evaluation takes every window
        tune_windows(tiny_tokenizer, PerplexityConfig(source=source, seq_len=32, max_windows=None))
