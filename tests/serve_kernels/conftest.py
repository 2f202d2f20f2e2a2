"""Shared helpers for the engine's tests: artifacts of every family, prompt logits of an engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.engine.sequence import Sequence


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The engine's ops are small: one intra-op thread avoids contention on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_family(model, tokenizer_dir: Path, out: Path) -> Path:
    """A transformers model saved as an artifact directory with the demo tokenizer."""
    from thresher.models import save_model

    save_model(model, None, out)
    for f in tokenizer_dir.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The engine's fp32 logits [len(ids), V] for a prompt, through the paged cache."""
    engine = llm.engine
    seq = Sequence("probe", ids, SamplingParams(max_tokens=1), 1)
    assert engine.block_manager.allocate(seq, len(ids))
    try:
        hidden, _ = engine.runner.hidden_states(ScheduledBatch([seq], [len(ids)]))
        return engine.runner.model.logits(hidden)
    finally:
        engine.block_manager.free(seq)
