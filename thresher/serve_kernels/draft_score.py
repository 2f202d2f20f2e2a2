"""How good a model is as a draft of another: one call for a flow or a script.

A compressed variant shares its parent's tokenizer and tracks its distribution, so it can serve
as the parent's speculative-decoding draft. ``draft_acceptance`` serves the target with the
draft (or prompt lookup, ``draft="ngram"``) over the validation prompts and reports the share of
proposals the target kept. At temperature 0 that share is a quality signal beside greedy
agreement: a proposal stands exactly when the draft's greedy token equals the target's after the
same prefix, so it is next-token agreement under the target's own continuation, measured k
tokens at a time.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from thresher.serve_kernels.engine.llm_engine import LLM
from thresher.serve_kernels.engine.sampling_params import SamplingParams
from thresher.serve_kernels.engine.speculative import SpeculativeConfig
from thresher.serve_kernels.validate import PROMPTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftScore:
    """One draft of one target at one temperature and k."""

    acceptance_rate: float  # proposals kept / proposals made
    mean_accepted_length: float  # tokens per verify step (kept proposals + the target's own)
    num_draft_tokens: int
    num_accepted_tokens: int
    tokens_per_second: float  # generated tokens over the generation's wall time

    def metrics(self, prefix: str = "validate/") -> dict[str, float]:
        """As MLflow metrics (``validate/draft_acceptance_rate``...), the names the flow logs."""
        return {f"{prefix}draft_acceptance_rate": self.acceptance_rate,
                f"{prefix}draft_mean_accepted_length": self.mean_accepted_length,
                f"{prefix}speculative_tokens_per_s": self.tokens_per_second}


def draft_acceptance(target: str | Path, draft: str | Path, *, temperature: float = 0.0,
                     num_speculative_tokens: int = 4, max_tokens: int = 64,
                     prompts: list[str] | None = None, dtype: str = "float32",
                     seed: int | None = 0) -> DraftScore:
    """Serve ``target`` with ``draft`` proposing and measure how many proposals stand: every
    sequence proposes at every step (no pacing), so that the share is over the whole
    continuation, comparable between drafts."""
    spec = SpeculativeConfig(str(draft), num_speculative_tokens, adaptive=False)
    llm = LLM(target, dtype=dtype, speculative=spec)
    prompts = prompts or PROMPTS
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                            seed=None if temperature == 0 else seed)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = llm.engine.spec_stats
    score = DraftScore(stats.acceptance_rate, stats.mean_accepted_length, stats.num_draft_tokens,
                       stats.num_accepted_tokens,
                       sum(len(o.token_ids) for o in outs) / seconds)
    log.info("draft %s of %s at temperature %g, k=%d: acceptance %.3f, %.2f tokens per verify",
             draft, target, temperature, num_speculative_tokens, score.acceptance_rate,
             score.mean_accepted_length)
    del llm
    gc.collect()
    return score


def plain_tokens_per_second(target: str | Path, *, max_tokens: int = 64,
                            prompts: list[str] | None = None, dtype: str = "float32") -> float:
    """``target``'s tokens/s without speculation, generating as ``draft_acceptance`` does (greedy,
    the same prompts in one batch): the denominator of a speculative speedup."""
    llm = LLM(target, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts or PROMPTS, params)
    seconds = time.perf_counter() - start
    del llm
    gc.collect()
    return sum(len(o.token_ids) for o in outs) / seconds
