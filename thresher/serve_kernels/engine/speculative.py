"""Speculative decoding: a drafter proposes up to k tokens per sequence, the target verifies them.

A decode step normally computes one token per sequence. With a drafter, each decoding sequence
gets up to k proposals appended to its tokens (``Sequence.num_proposed`` of them), and the
target scores the last accepted token plus every proposal in one forward pass over the paged
cache: a multi-token chunk whose positions continue the sequence, exactly as a prefill chunk.
The runner returns logits at those 1 + k positions, and the acceptance rule decides how many
proposals stand; the rest are cut from the tokens and their KV slots released.

Two acceptance rules, both exact (the output follows the target's distribution):

- *match*: the target chooses its token at every position as plain decoding would (argmax, or a
  draw with the request's seed and position); proposals stand while they equal those choices,
  and the first differing choice is emitted. Greedy output is token-for-token plain decoding's,
  and so is a seeded request's. For a drafter with a point-mass proposal (prompt lookup) this is
  the rejection rule below: a proposal x is kept with probability p(x).
- *rejection* (Leviathan et al. 2023, Chen et al. 2023): a sampled proposal x ~ q stands with
  probability min(1, p(x) / q(x)); on the first rejection a token is drawn from
  norm(max(0, p - q)); when all stand, a bonus token is drawn from p. Used for an unseeded,
  sampling request without log-probs under a draft model, where it accepts more than *match*.

``p`` and ``q`` are the distributions the sampler draws from (logit bias, min_tokens' mask and
penalties over the tokens so far including earlier proposals, then temperature, top-k, top-p,
min-p), so every
sampling parameter stays exact under speculation.

Drafters: ``NgramDrafter`` (prompt lookup: the tokens that followed the latest earlier
occurrence of the sequence's last n tokens) and ``ModelDrafter`` (a smaller model with the same
vocabulary, decoding k steps over its own paged KV cache beside the target's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from thresher.serve_kernels.engine.block_manager import BlockManager
from thresher.serve_kernels.engine.block_table import BlockTables
from thresher.serve_kernels.engine.model_runner import ModelRunner
from thresher.serve_kernels.engine.sampler import Sampler, _argmax, adjust_logits
from thresher.serve_kernels.engine.sampling_params import SamplingParams
from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.engine.sequence import Sequence

log = logging.getLogger(__name__)

NGRAM = "ngram"
MAX_SPECULATIVE_TOKENS = 16
# Accepted proposals per verify (a sequence's recent mean) below which it stops proposing for a
# while: a verify chunk costs 1.1-1.6x a decode step on the models measured (docs/benchmarks.md,
# "Speculative decoding"), so a verify that accepts under about 0.3 tokens loses time
PAYOFF_FLOOR = 0.3
FIRST_PAUSE, MAX_PAUSE = 2, 64  # decode steps without proposals; doubled after each failed probe


@dataclass(frozen=True)
class SpeculativeConfig:
    """``draft``: "ngram" (prompt lookup) or a model the engine can serve with the target's
    vocabulary; ``num_speculative_tokens``: proposals per sequence and step (k)."""

    draft: str
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1  # shortest suffix n-gram prompt lookup matches
    prompt_lookup_max: int = 4  # longest (tried first)
    adaptive: bool = True  # a sequence whose proposals stop paying pauses them (``Pacing``)

    def __post_init__(self) -> None:
        if not self.draft:
            raise ValueError("draft: empty; give 'ngram' or a model to draft with")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: must be in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                             f"{self.prompt_lookup_max}: need 1 <= min <= max")


@dataclass
class Pacing:
    """Whether a sequence proposes this step. A verify whose proposals all fail costs a chunk's
    forward for one token, more than a step (a chunk's tokens route to more experts); where the
    model's continuation does not follow its drafter that is every verify. So a sequence whose
    recent verifies accepted fewer than ``PAYOFF_FLOOR`` proposals on average (a mean that
    halves the weight of the past at each verify) decodes plainly for ``FIRST_PAUSE`` steps,
    then proposes again; each probe that still does not pay doubles the pause, up to
    ``MAX_PAUSE``, and one that pays ends the pausing. Output is unchanged: only how often the
    target verifies."""

    gain: float = 1.0  # recent accepted proposals per verify
    pause: int = 0  # decode steps left without proposals
    next_pause: int = FIRST_PAUSE

    def proposes(self) -> bool:
        """Called once per decode step of the sequence."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def record(self, accepted: int) -> None:
        self.gain = 0.5 * (self.gain + accepted)
        if self.gain >= PAYOFF_FLOOR:
            self.next_pause = FIRST_PAUSE
            return
        self.pause = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE)


def uses_rejection(params: SamplingParams) -> bool:
    """Whether a request's proposals are judged by the rejection rule (else by *match*).

    Seeded requests keep plain decoding's exact tokens and log-prob requests get them from the
    sampler's own choices, both of which *match* preserves."""
    return not params.greedy and params.seed is None and params.logprobs is None


@dataclass
class Proposal:
    """One sequence's proposals and, for the rejection rule, the distributions they came from."""

    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # [len(tokens), V] draft probabilities (None: point masses)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, tokens: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """The tokens emitted for proposals ``tokens`` ~ ``q`` [k, V] given the target's ``p``
    [k + 1, V]: the proposals that stand, then one token from the residual or the bonus row."""
    k = len(tokens)
    idx = torch.tensor(tokens, device=p.device)
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, idx] / q[rows, idx]
    u = torch.rand(k, generator=generator, device=p.device)
    rejected = (u >= ratio).nonzero()
    if len(rejected) == 0:
        return [*tokens, int(torch.multinomial(p[k], 1, generator=generator))]
    i = int(rejected[0])
    residual = (p[i] - q[i]).clamp_min(0)
    if not residual.sum() > 0:  # p == q up to rounding: rejection had probability ~0
        residual = p[i]
    return [*tokens[:i], int(torch.multinomial(residual, 1, generator=generator))]


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the suffix."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(seq.token_ids, k)) for seq, k in zip(seqs, ks, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing the longest suffix n-gram seen earlier in ``token_ids``
        (its latest occurrence among the longest).

        Every match ends on an earlier occurrence of the last token, so one comparison over the
        sequence finds the candidates, and the suffix is extended only at those (a few per step,
        against one comparison per n-gram length over the whole sequence)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        ends = np.flatnonzero(ids[:-1] == ids[-1])  # candidate n-gram ends with a successor
        if not len(ends):
            return []
        longest = min(self.max_n, len(ids) - 1)
        length = np.ones(len(ends), dtype=np.int64)  # matched suffix length at each candidate
        alive = np.ones(len(ends), dtype=bool)
        for j in range(1, longest):
            at = ends - j
            alive &= at >= 0
            alive[alive] &= ids[at[alive]] == ids[-1 - j]
            if not alive.any():
                break
            length += alive
        for n in range(longest, self.min_n - 1, -1):
            hits = np.flatnonzero(length >= n)
            if len(hits):
                start = int(ends[hits[-1]]) + 1
                return ids[start : start + k].tolist()
        return []

    def release(self, request_id: str) -> None:
        """Nothing is kept per sequence."""


class ModelDrafter:
    """A draft model decoding k steps per target step over its own paged KV cache.

    Each target sequence has a mirror ``Sequence`` here; before proposing, the mirror's tokens
    are brought level with the target's (proposals the target rejected are cut, their KV slots
    released, and the target's new tokens computed in the first draft step)."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, tables: BlockTables,
                 max_model_len: int, eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.runner, self.block_manager, self.tables = runner, block_manager, tables
        self.max_model_len = max_model_len
        self.sampler = Sampler(eos_token_ids)
        self.mirrors: dict[str, Sequence] = {}
        self.synced: dict[str, int] = {}  # request id -> mirror tokens copied from the target

    def _sync(self, seq: Sequence) -> Sequence:
        """The sequence's mirror, its tokens made the target's; the KV of cut tokens released.

        The mirror's first ``synced`` tokens were copied from the target, which only appends,
        so they still agree; past them, its proposals agree up to the first the target
        rejected."""
        d = self.mirrors.get(seq.request_id)
        if d is None:
            # plain params: the draft samples with the request's, and scores no prompt
            d = Sequence(seq.request_id, seq.prompt_token_ids, SamplingParams(), self.max_model_len)
            self.mirrors[seq.request_id] = d
            self.synced[seq.request_id] = d.num_tokens
        n, limit = self.synced[seq.request_id], min(d.num_tokens, seq.num_tokens)
        while n < limit and d.token_ids[n] == seq.token_ids[n]:
            n += 1
        del d.token_ids[n:]
        d.token_ids.extend(seq.token_ids[n:])
        self.synced[seq.request_id] = d.num_tokens
        d.num_computed_tokens = min(d.num_computed_tokens, n, d.num_tokens - 1)
        self.block_manager.truncate(d)
        return d

    def _make_room(self, active: set[str]) -> None:
        """Release the mirrors of sequences not proposing this step (preempted ones, say), so
        that the step's own mirrors find block-table rows and blocks."""
        for request_id in [r for r in self.mirrors if r not in active]:
            self.release(request_id)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        active = {s.request_id for s in seqs}
        if sum(r not in self.mirrors for r in active) > self.tables.num_free_rows:
            self._make_room(active)
        mirrors = [self._sync(s) for s in seqs]
        proposals = [Proposal() for _ in seqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        alive = [True] * len(seqs)
        for step in range(max(ks, default=0)):
            chosen = [i for i, k in enumerate(ks) if k > step and alive[i]]
            scheduled = []
            for i in chosen:
                d = mirrors[i]
                n = d.num_tokens - d.num_computed_tokens
                if not self.block_manager.allocate(d, n) and len(self.mirrors) > len(active):
                    self._make_room(active)
                if self.block_manager.allocate(d, n):
                    scheduled.append((i, n))
                else:  # the draft cache is full: this sequence goes without proposals
                    alive[i] = False
                    self.release(seqs[i].request_id)
            if not scheduled:
                break
            scheduled.sort(key=lambda c: c[1] != 1)
            batch = ScheduledBatch([mirrors[i] for i, _ in scheduled], [n for _, n in scheduled])
            logits = self.runner.run(batch).logits
            params = [seqs[i].params for i, _ in scheduled]
            if any(p.adjusts_logits for p in params):
                logits = adjust_logits(logits, params,
                                       [mirrors[i].output_token_ids for i, _ in scheduled],
                                       self.sampler.eos_token_ids)
            tokens = _argmax(logits).tolist()
            rejection = [r for r, p in enumerate(params) if uses_rejection(p)]
            if rejection:
                idx = torch.tensor(rejection, device=logits.device)
                q = self.sampler.probs(logits[idx], [params[r] for r in rejection])
                drawn = torch.multinomial(q, 1).squeeze(-1).tolist()
                for j, r in enumerate(rejection):
                    tokens[r] = drawn[j]
                    q_rows[scheduled[r][0]].append(q[j])
            for (i, n), token in zip(scheduled, tokens, strict=True):
                mirrors[i].num_computed_tokens += n
                mirrors[i].token_ids.append(token)
                proposals[i].tokens.append(token)
        for i, prop in enumerate(proposals):
            if q_rows[i]:
                prop.q = torch.stack(q_rows[i])
            if not alive[i]:
                proposals[i] = Proposal()
        return proposals

    def release(self, request_id: str) -> None:
        """Free a finished or aborted sequence's mirror and its draft KV blocks."""
        d = self.mirrors.pop(request_id, None)
        self.synced.pop(request_id, None)
        if d is not None:
            self.block_manager.free(d)


@dataclass
class SpeculativeStats:
    """Counters under vLLM's spec-decode metric names (``vllm:spec_decode_*``)."""

    num_drafts: int = 0  # sequences that verified proposals, summed over steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: the accepted proposals plus the target's own one."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
