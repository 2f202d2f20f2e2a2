"""What a request asks of generation, and what the engine hands back per step.

Every option is checked when the parameters are built (and against the vocabulary when the
engine admits them), so nothing a request asks for can make a batched sampling step fail: a
failure there would cost every other sequence in the batch its step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thresher.serve_kernels.engine.speculative import SpeculativeStats

GREEDY_EPS = 1e-5  # a temperature below this samples greedily (as vLLM): dividing by it overflows
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_REPETITION_PENALTY = 10.0  # vLLM takes any positive value; past 10 no token repeats anyway


class InvalidSamplingParam(ValueError):
    """One sampling option out of range; ``field`` names it (the server's error ``param``)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidSamplingParam(name, f"{value} is not a finite number")


@dataclass
class SamplingParams:
    """Decoding options of one request (vLLM's names and meanings)."""

    temperature: float = 1.0  # below GREEDY_EPS = greedy
    top_p: float = 1.0  # 0 keeps only the most likely token
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # subtracted once from the logit of every generated token
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token
    # every token of the prompt and output: its logit divided by this if positive, else times it
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked, stop strings not checked
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    max_tokens: int | None = 16  # None = up to the context limit; 0 only with prompt_logprobs
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # same seed, same sample, whatever the batch (``sampler``'s noise)
    ignore_eos: bool = False
    logprobs: int | None = None  # log-prob of each sampled token, plus the top-N alternatives
    prompt_logprobs: bool = False  # log-prob of every prompt token (the first is None)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _finite(name, getattr(self, name))
        if self.temperature < 0:
            raise InvalidSamplingParam("temperature", f"{self.temperature} must be >= 0 (0 = "
                                       "greedy)")
        for name in ("top_p", "min_p"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidSamplingParam(name, f"{getattr(self, name)} must be in [0, 1]")
        if self.top_k < -1:
            raise InvalidSamplingParam("top_k", f"{self.top_k} must be -1 or 0 (off) or >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) > MAX_PENALTY:
                raise InvalidSamplingParam(name, f"{getattr(self, name)} must be in "
                                           f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidSamplingParam("repetition_penalty", f"{self.repetition_penalty} must be "
                                       f"in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        if self.min_tokens < 0 or (self.max_tokens is not None
                                   and self.min_tokens > self.max_tokens):
            raise InvalidSamplingParam("min_tokens", f"{self.min_tokens} must be in [0, "
                                       f"max_tokens={self.max_tokens}]")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise InvalidSamplingParam("logit_bias", f"token id {token} is negative")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParam("logit_bias", f"the bias of token {token} ({bias}) "
                                           f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingParam("stop_token_ids", "token ids must be non-negative")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidSamplingParam("seed", f"{self.seed} is not a 64-bit integer")
        if self.max_tokens is not None and (
            self.max_tokens < 0 or (self.max_tokens == 0 and not self.prompt_logprobs)
        ):
            raise InvalidSamplingParam("max_tokens", f"{self.max_tokens} must be >= 1 (0 only "
                                       "to score a prompt with prompt_logprobs=True)")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidSamplingParam("logprobs", f"{self.logprobs} must be >= 0 (or None)")
        if any(not s for s in self.stop):
            raise InvalidSamplingParam("stop", "stop strings must be non-empty")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a top_k, a logit_bias token or a stop token beyond the model's vocabulary."""
        if self.top_k > vocab_size:
            raise InvalidSamplingParam("top_k", f"{self.top_k} exceeds the vocabulary size "
                                       f"({vocab_size}); use -1 to turn top-k off")
        for name, ids in (("logit_bias", self.logit_bias),
                          ("stop_token_ids", self.stop_token_ids)):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise InvalidSamplingParam(name, f"token id {outside[0]} is outside the "
                                           f"vocabulary (size {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit_bias, a penalty or min_tokens changes this request's logits before
        sampling."""
        return (bool(self.logit_bias) or bool(self.presence_penalty or self.frequency_penalty)
                or self.repetition_penalty != 1.0 or self.min_tokens > 0)

    def ended_by(self, eos_token_ids: Sequence[int]) -> list[int]:
        """The tokens that would end the request (``min_tokens`` masks them): end-of-sequence
        unless ``ignore_eos``, and ``stop_token_ids``."""
        return [*([] if self.ignore_eos else eos_token_ids), *self.stop_token_ids]


@dataclass
class RequestOutput:
    """A request's state after a step; ``text`` only grows until the request finishes.

    From ``LLMEngine.step`` the token and log-prob fields are read-only ``Snapshot`` views of the
    engine's growing lists (no per-step copy); ``LLM``'s final outputs hold plain lists."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: Sequence[int]  # all generated so far
    text: str  # detokenized generated text so far (stop strings cut)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    new_token_ids: list[int]  # generated in this step (for streaming)
    prompt_logprobs: Sequence[float | None] | None
    logprobs: Sequence[float] | None  # per generated token
    num_cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    top_logprobs: Sequence[dict[int, float]] | None = None  # per generated token, with logprobs=N
    # per prompt token (the first None), with prompt_logprobs and logprobs=N
    prompt_top_logprobs: Sequence[dict[int, float] | None] | None = None
    error: str | None = None  # why the engine failed this request alone (finish_reason "error")
    num_draft_tokens: int = 0  # speculative proposals verified for it so far
    num_accepted_tokens: int = 0  # of which the target kept


@dataclass
class EngineStats:
    """Counters for monitoring (the server's /metrics)."""

    num_waiting: int
    num_running: int
    num_preempted_total: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    prefix_cache_hit_tokens: int
    generated_tokens_total: int
    prompt_tokens_total: int
    spec: SpeculativeStats | None = None  # with speculative decoding
