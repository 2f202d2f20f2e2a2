import json

import pytest
import torch

from thresher.data.sources import iter_documents, stdlib_files, stdlib_split_of
from thresher.data.windows import calibration_windows, eval_windows
from thresher.errors import DataError
from thresher.recipe import CalibrationConfig, FilesSource, PerplexityConfig


def test_stdlib_split_is_deterministic_and_disjoint():
    train, held = stdlib_files("train"), stdlib_files("heldout")
    assert train and held and not set(train) & set(held)
    assert 0.03 < len(held) / (len(train) + len(held)) < 0.2
    assert stdlib_split_of("json/decoder.py") == stdlib_split_of("json/decoder.py")
    assert not any("/test/" in str(p) or "idlelib" in str(p) for p in train + held)


def test_files_source_reads_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "x1"}) + "\n\n" + json.dumps({"body": "x2"}))
    docs = list(iter_documents(FilesSource(files=[str(tmp_path / "*")], field="body")))
    assert docs == ["hello", "x1", "x2"]
    with pytest.raises(DataError, match="matches no file"):
        list(iter_documents(FilesSource(files=[str(tmp_path / "*.nope")])))
    (tmp_path / "c.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(DataError, match="no field 'body'"):
        list(iter_documents(FilesSource(files=[str(tmp_path / "c.jsonl")], field="body")))


def test_windows_are_seeded_and_shaped(tiny_tokenizer):
    cfg = CalibrationConfig(samples=5, seq_len=32, seed=3)
    a, b = calibration_windows(tiny_tokenizer, cfg), calibration_windows(tiny_tokenizer, cfg)
    assert a.shape == (5, 32) and torch.equal(a, b)
    c = calibration_windows(tiny_tokenizer, CalibrationConfig(samples=5, seq_len=32, seed=4))
    assert not torch.equal(a, c)
    ev = eval_windows(tiny_tokenizer, PerplexityConfig(seq_len=64, max_windows=3))
    assert ev.shape == (3, 64)
    # non-overlapping: consecutive windows continue the same token stream
    full = eval_windows(tiny_tokenizer, PerplexityConfig(seq_len=128, max_windows=1))
    assert torch.equal(full[0], torch.cat([ev[0], ev[1]]))
