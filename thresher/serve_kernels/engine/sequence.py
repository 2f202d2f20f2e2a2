"""One request as the scheduler sees it: its tokens, its KV blocks, how far it has been computed.

``num_computed_tokens`` is how many of ``token_ids`` have K/V in the cache. A step schedules
``num_tokens - num_computed_tokens`` new tokens (a whole prompt, a chunk of it, or the one token
sampled last step); when a step reaches the end of ``token_ids`` the sequence samples its next
token. Preemption drops the blocks and resets ``num_computed_tokens`` to 0: the sequence is
recomputed from its prompt plus everything it generated, so its output continues unchanged.
"""

from __future__ import annotations

import enum
import time

import torch

from thresher.serve_kernels.engine.detokenizer import PROMPT_CONTEXT
from thresher.serve_kernels.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's tokens, KV blocks, progress and outputs."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int):
        self.request_id = request_id
        self.params = params
        self.max_tokens = max_tokens  # resolved against the context limit
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the engine failed this request alone
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chain hashes of the leading full blocks
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0  # set on first admission
        self.admitted = False
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top_logprobs: list[dict[int, float]] | None = (
            [] if params.logprobs else None)
        self.prompt_logprobs: list[float | None] | None = (
            [None] if params.prompt_logprobs else None)
        self.text = ""  # detokenized output (before stop-string holdback)
        # incremental detokenizer window over token_ids, first opened on the prompt's tail
        self.prefix_offset = max(self.num_prompt_tokens - PROMPT_CONTEXT, 0)
        self.read_offset = self.num_prompt_tokens
        self.arrival_time = time.perf_counter()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probs still to compute (they need logits at every prompt position)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
