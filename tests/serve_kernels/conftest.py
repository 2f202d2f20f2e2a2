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


def assert_tracks_reference(llm: LLM, prompts: list[list[int]], fast: list[list[int]],
                            fast_logits: list[torch.Tensor]) -> None:
    """A fast kernel's greedy tokens, teacher-forced through the path now in force (the
    reference): logits within 2% of their scale, each chosen token the best or within 1% of it
    (a near-tie may flip between bf16 kernels and the fp32 reference)."""
    for prompt, tokens, got in zip(prompts, fast, fast_logits, strict=True):
        ref = prompt_logits(llm, prompt + tokens)
        scale = ref.abs().max()
        assert (got - ref).abs().max() < 0.02 * scale
        steps = ref[len(prompt) - 1: -1]  # the logits that chose each generated token
        chosen = steps.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert (steps.max(1).values - chosen).max() < 0.01 * scale  # best, or a near-tie
