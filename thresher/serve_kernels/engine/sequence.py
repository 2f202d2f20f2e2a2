"""One request as the scheduler sees it: its tokens, its KV blocks, how far it has been computed.

``num_computed_tokens`` is how many of ``token_ids`` have K/V in the cache. A step schedules
``num_tokens - num_computed_tokens`` new tokens (a whole prompt, a chunk of it, or the one token
sampled last step); when a step reaches the end of ``token_ids`` the sequence samples its next
token. Preemption drops the blocks and resets ``num_computed_tokens`` to 0: the sequence is
recomputed from its prompt plus everything it generated, so its output continues unchanged.
"""

from __future__ import annotations

import codecs
import enum
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from itertools import islice
from typing import TYPE_CHECKING, Generic, TypeVar

from thresher.serve_kernels.engine.detokenizer import PROMPT_CONTEXT
from thresher.serve_kernels.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from thresher.serve_kernels.engine.speculative import Pacing

T = TypeVar("T")


class Snapshot(SequenceABC, Generic[T]):
    """``items[start:stop]`` of an append-only list, as it is now, without copying it.

    A step reports every sequence's tokens (and log-probs) so far; copying them each step cost
    O(context) per sequence. Items before ``stop`` never change (the engine only appends), so a
    view bounded at ``stop`` is a snapshot. It compares equal to a list of the same items.
    """

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list[T], start: int = 0, stop: int | None = None):
        self._items, self._start = items, start
        self._stop = len(items) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._items[self._start : self._stop][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("snapshot index out of range")
        return self._items[self._start + (i % n)]

    def __iter__(self) -> Iterator[T]:
        return islice(self._items, self._start, self._stop)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SequenceABC) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def context(self) -> Snapshot[T]:
        """Every item before this snapshot's end, from the list's start (a sequence's prompt and
        the tokens generated before this position)."""
        return Snapshot(self._items, 0, self._stop)

    def __add__(self, other: SequenceABC) -> list:
        return [*self, *other]

    def __radd__(self, other: SequenceABC) -> list:
        return [*other, *self]

    __hash__ = None  # mutable-looking, like a list

    def __repr__(self) -> str:
        return repr(list(self))


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
        self.prompt_token_ids = list(prompt_token_ids)  # kept apart: outputs hand it out
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the engine failed this request alone
        self.block_table: list[int] = []
        self.table_row: int | None = None  # its row in the persistent BlockTables, if any
        self.block_hashes: list[bytes] = []  # chain hashes of the leading full blocks
        self.num_computed_tokens = 0
        self.num_proposed = 0  # trailing token_ids that are speculative proposals being verified
        self.num_draft_tokens = 0  # proposals verified for it, over its life
        self.num_accepted_tokens = 0  # of which the target kept
        self.pacing: Pacing | None = None  # when it proposes (speculative decoding with pacing)
        self.num_cached_prompt_tokens = 0  # set on first admission
        self.admitted = False
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top_logprobs: list[dict[int, float]] | None = (
            [] if params.logprobs else None)
        self.prompt_logprobs: list[float | None] | None = (
            [None] if params.prompt_logprobs else None)
        # with logprobs=N too: the N most likely tokens at each prompt position
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs and params.logprobs else None)
        self.text = ""  # detokenized output (before stop-string holdback)
        # incremental detokenizer window over token_ids, first opened on the prompt's tail
        self.prefix_offset = max(self.num_prompt_tokens - PROMPT_CONTEXT, 0)
        self.read_offset = self.num_prompt_tokens
        self.utf8: codecs.IncrementalDecoder | None = None  # the byte-level detokenizer's state
        self.arrival_time = time.perf_counter()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> Snapshot[int]:
        return Snapshot(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probs still to compute (they need logits at every prompt position)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
