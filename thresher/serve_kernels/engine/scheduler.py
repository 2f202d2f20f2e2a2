"""Continuous batching: which sequences run this step, and how many new tokens each.

Every step has a budget of ``max_num_batched_tokens`` new tokens. Running sequences go first, in
admission order: a decoding sequence takes 1 token, one in the middle of a long prompt takes the
next chunk that fits (chunked prefill). If the KV cache has no block for a running sequence, the
most recently admitted running sequence is preempted (its blocks freed, to be recomputed later)
until it fits. Then waiting sequences are admitted in arrival order while budget, blocks and
``max_num_seqs`` allow; an admitted sequence first takes the blocks of its cached prefix.
Finished sequences leave at once, so new requests join between any two steps.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from thresher.serve_kernels.engine.block_manager import BlockManager
from thresher.serve_kernels.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """The sequences of one step and their new-token counts, single-token ones first."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Waiting and running queues over one block manager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted_total = 0
        self.prefix_hit_tokens_total = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                break
            chosen.append((seq, n))
            budget -= n
            i += 1

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hit = self.block_manager.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free(seq)
                break
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_prompt_tokens = hit
            self.prefix_hit_tokens_total += hit
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n

        chosen.sort(key=lambda c: c[1] != 1)  # stable: decode-shaped rows first
        return ScheduledBatch([c[0] for c in chosen], [c[1] for c in chosen])

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it waits at the front to be recomputed."""
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preempted_total += 1
        log.debug("preempted %s at %d tokens", seq.request_id, seq.num_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks (it may be running or waiting)."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
