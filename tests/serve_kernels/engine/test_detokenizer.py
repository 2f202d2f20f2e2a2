"""Incremental detokenization with a SentencePiece-style tokenizer (Metaspace, byte fallback).

The demo tokenizer is byte-level and keeps every space; a Llama-2/Mistral-style tokenizer drops
the leading space of the text it decodes, which only the prompt context in the first window saves.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from thresher.models.loading import load_tokenizer
from thresher.serve_kernels import SamplingParams
from thresher.serve_kernels.engine.detokenizer import (
    Detokenizer,
    append_text,
    find_stop,
    visible_text,
)
from thresher.serve_kernels.engine.sequence import Sequence

TEXT = "Hello world, the quick brown fox jumps over the lazy dog. naïve café 東京 😀 done"


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A small BPE trained here with Metaspace pre-tokenizer and decoder and byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    corpus = ["Hello world, the quick brown fox jumps over the lazy dog.",
              "def main(): return hello world", "naïve café résumé 東京"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    # the trainer puts the byte tokens in the vocabulary as special tokens; in Llama's tokenizer
    # they are ordinary tokens, which decoding with skip_special_tokens keeps
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def detokenize(tokenizer, prompt: list[int], output: list[int], stop: list[str] | None = None
               ) -> tuple[str, str]:
    """(final text, the streamed visible-text deltas joined) of ``output`` after ``prompt``."""
    seq = Sequence("s", prompt, SamplingParams(stop=stop or []), len(output))
    streamed = ""
    for token in output:
        seq.token_ids.append(token)
        before = len(seq.text)
        append_text(tokenizer, seq)
        if stop and (at := find_stop(seq, len(seq.text) - before)) is not None:
            seq.text = seq.text[:at]
            break
        streamed += visible_text(seq)[len(streamed):]
    return seq.text, streamed


def test_the_first_generated_word_keeps_its_leading_space(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.unk_token_id not in ids
    for split in range(1, len(ids)):
        prompt, output = ids[:split], ids[split:]
        if tok.decode(prompt).endswith("\ufffd"):  # cut inside a character: no text to continue
            continue
        text, streamed = detokenize(tok, prompt, output)
        assert tok.decode(prompt) + text == tok.decode(ids) == TEXT, split
        assert streamed == text, split


def test_stop_strings_with_a_sentencepiece_tokenizer(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    split = len(tok.encode("Hello world,", add_special_tokens=False))
    text, streamed = detokenize(tok, ids[:split], ids[split:], stop=[" fox"])
    assert text == " the quick brown"
    assert text.startswith(streamed)


@pytest.fixture(scope="module")
def byte_level_tokenizer(tiny_demo):
    return load_tokenizer(tiny_demo)


def stream(detokenizer: Detokenizer, prompt: list[int], output: list[int],
           stop: list[str] | None = None) -> tuple[str, str]:
    """``detokenize`` through an engine's ``Detokenizer``."""
    seq = Sequence("s", prompt, SamplingParams(stop=stop or []), len(output))
    streamed = ""
    for token in output:
        seq.token_ids.append(token)
        before = len(seq.text)
        detokenizer.append_text(seq)
        if stop and (at := find_stop(seq, len(seq.text) - before)) is not None:
            seq.text = seq.text[:at]
            break
        streamed += visible_text(seq)[len(streamed):]
    return seq.text, streamed


def test_byte_level_detokenizing_equals_full_decoding(byte_level_tokenizer):
    """The demo tokenizer takes the byte table; text streamed token by token, with characters
    of 2, 3 and 4 bytes split across tokens, equals decoding the whole output at every split."""
    tok = byte_level_tokenizer
    detok = Detokenizer(tok)
    assert detok.token_bytes is not None
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some character really is split across tokens
    for split in range(0, len(ids)):
        text, streamed = stream(detok, ids[:split], ids[split:])
        assert text == streamed == tok.decode(ids[split:]), split
    special = tok.all_special_ids[0]  # skipped, as decoding with skip_special_tokens does
    assert stream(detok, ids[:3], [special, *ids[3:]])[0] == tok.decode(ids[3:])


def test_byte_level_stop_strings(byte_level_tokenizer):
    detok = Detokenizer(byte_level_tokenizer)
    ids = byte_level_tokenizer.encode(TEXT, add_special_tokens=False)
    text, streamed = stream(detok, ids[:2], ids[2:], stop=["東京"])
    assert text == byte_level_tokenizer.decode(ids[2:]).split("東京")[0]
    assert text.startswith(streamed) and "東" not in streamed


def test_other_tokenizers_decode_by_windows(sentencepiece_tokenizer):
    """A Metaspace decoder is not plain byte-level: no table, and the windowed path gives the
    full decoding."""
    tok = sentencepiece_tokenizer
    detok = Detokenizer(tok)
    assert detok.token_bytes is None
    ids = tok.encode(TEXT, add_special_tokens=False)
    split = len(tok.encode("Hello world,", add_special_tokens=False))
    text, streamed = stream(detok, ids[:split], ids[split:])
    assert tok.decode(ids[:split]) + text == TEXT and streamed == text
