"""What a request asks of generation, and what the engine hands back per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Decoding options of one request (vLLM's names and meanings)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int | None = 16  # None = up to the context limit; 0 only with prompt_logprobs
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # per-request generator: same seed, same sample, whatever the batch
    ignore_eos: bool = False
    logprobs: int | None = None  # log-prob of each sampled token, plus the top-N alternatives
    prompt_logprobs: bool = False  # log-prob of every prompt token (the first is None)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: must be -1 (off) or >= 1")
        if self.max_tokens is not None and (
            self.max_tokens < 0 or (self.max_tokens == 0 and not self.prompt_logprobs)
        ):
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1 (0 only to score a "
                             "prompt with prompt_logprobs=True)")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs}: must be >= 0 (or None)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """A request's state after a step; ``text`` only grows until the request finishes."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # detokenized generated text so far (stop strings cut)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    new_token_ids: list[int]  # generated in this step (for streaming)
    prompt_logprobs: list[float | None] | None
    logprobs: list[float] | None  # per generated token
    num_cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    top_logprobs: list[dict[int, float]] | None = None  # per generated token, with logprobs=N


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
