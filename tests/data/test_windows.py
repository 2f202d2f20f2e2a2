"""Tokenizing a corpus in chunks gives the ids of tokenizing it whole, at bounded memory."""

import torch

from thresher.data.sources import load_text
from thresher.data.windows import text_chunks


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
