"""Speculative decoding: the same greedy tokens as plain decoding, the target's distribution when
sampling, every KV block (the target's and the draft's) back when requests end."""

from __future__ import annotations

import json.decoder

import pytest
import torch
from scipy import stats

from tests.conftest import build_random_model
from tests.serve_kernels.conftest import prompt_logits, save_family
from thresher.compress.api import quantize_model
from thresher.errors import ModelError
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.block_manager import BlockManager
from thresher.serve_kernels.engine.block_table import BlockTables
from thresher.serve_kernels.engine.sequence import Sequence
from thresher.serve_kernels.engine.speculative import (
    FIRST_PAUSE,
    MAX_PAUSE,
    NgramDrafter,
    Pacing,
    SpeculativeConfig,
    rejection_sample,
)

CAL = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=2, seq_len=16)
# code the demo models know, of different lengths, with different max_tokens: the batch mixes
# prefill chunks, verify chunks of different sizes and sequences that finish at different steps
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    ",
           "class Queue:\n    def __init__(self",
           "for key, value in sorted(mapping.items()):\n    if key",
           "    return self."]
MAX_TOKENS = [48, 20, 33, 40]


def _greedy(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def _assert_all_freed(llm: LLM) -> None:
    engine = llm.engine
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.tables.num_free_rows == len(engine.block_manager.tables.tables)
    drafter = engine.drafter
    if hasattr(drafter, "block_manager"):
        assert drafter.block_manager.num_used_blocks == 0 and not drafter.mirrors


@pytest.fixture(scope="module")
def tiny_q4(tiny_demo, tmp_path_factory):
    """demo:tiny quantized to 4 bits (RTN, group 32)."""
    out = tmp_path_factory.mktemp("spec") / "rtn4"
    quantize_model(tiny_demo, QuantizeStage(method="rtn", group_size=32), CAL, out,
                   show_progress=False)
    return out


@pytest.fixture(scope="module")
def plain(tiny_demo, tiny_q4):
    """Plain greedy tokens of each target."""
    return {"tiny": _greedy(LLM(tiny_demo)), "q4": _greedy(LLM(tiny_q4))}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("target,draft", [("tiny", "ngram"), ("tiny", "q4"), ("q4", "ngram"),
                                          ("q4", "tiny")])
def test_greedy_speculation_gives_plain_decodings_tokens(target, draft, k, tiny_demo, tiny_q4,
                                                         plain):
    paths = {"tiny": str(tiny_demo), "q4": str(tiny_q4)}
    llm = LLM(paths[target], speculative=SpeculativeConfig(paths.get(draft, draft), k))
    assert _greedy(llm) == plain[target]
    spec = llm.engine.spec_stats
    assert spec.num_drafts > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert len(spec.accepted_per_position) <= k
    _assert_all_freed(llm)


def test_sampling_params_stay_exact_under_speculation(tiny_demo):
    """Penalties and logit bias (over tokens that include earlier proposals), a seeded draw,
    log-probs, the repetition penalty and min_tokens: the same tokens (and log-probs) as plain
    decoding."""
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.8,
                       frequency_penalty=0.5, logit_bias={13: 4.0, 220: -3.0}),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=11, max_tokens=30,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.5, min_tokens=20,
                       stop_token_ids=[13]),
    ]
    base = LLM(tiny_demo).generate(PROMPTS[:4], params)
    for draft in ("ngram", str(tiny_demo)):
        llm = LLM(tiny_demo, speculative=SpeculativeConfig(draft, 4))
        got = llm.generate(PROMPTS[:4], params)
        for b, g in zip(base, got, strict=True):
            assert g.token_ids == b.token_ids
        assert got[2].logprobs == pytest.approx(base[2].logprobs, abs=1e-4)
        assert [list(t) for t in got[2].top_logprobs] == [list(t) for t in base[2].top_logprobs]
        assert llm.engine.spec_stats.num_accepted_tokens > 0
        _assert_all_freed(llm)


def test_stop_inside_accepted_proposals_ends_there(tiny_demo):
    """A stop token that arrives among several accepted tokens ends the request at it."""
    plain = LLM(tiny_demo).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40,
                                                               ignore_eos=True))[0].token_ids
    stop = plain[17]
    p = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop], ignore_eos=True)
    want = LLM(tiny_demo).generate(PROMPTS[0], p)[0]
    llm = LLM(tiny_demo, speculative=SpeculativeConfig(str(tiny_demo), 5))
    got = llm.generate(PROMPTS[0], p)[0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop
    assert got.text == want.text and got.finish_reason == "stop"
    _assert_all_freed(llm)


def test_rejection_rule_emits_the_target_distribution():
    """Against the math: the first emitted token is distributed as p[0] whatever q is, and the
    first proposal stands with probability sum(min(p, q))."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 6, 20000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 2, -1)
    first, stood = torch.zeros(vocab), 0
    for _ in range(trials):
        tokens = torch.multinomial(q, 1, generator=gen).squeeze(-1).tolist()
        out = rejection_sample(p, q, tokens, gen)
        first[out[0]] += 1
        stood += len(out) > 1 and out[0] == tokens[0]
    expected = p[0].double() / p[0].double().sum() * trials
    assert stats.chisquare(first.double(), expected).pvalue > 1e-3
    accept = torch.minimum(p[0], q[0]).sum().item()
    assert abs(stood / trials - accept) < 4 * (accept * (1 - accept) / trials) ** 0.5


@pytest.fixture(scope="module")
def small_vocab_pair(tiny_demo, tmp_path_factory):
    """Two random models over a 12-token vocabulary: a target and a different draft."""
    root = tmp_path_factory.mktemp("vocab12")
    kw = dict(vocab_size=12, hidden_size=32, num_layers=1, intermediate_size=32)
    return (save_family(build_random_model("qwen3_moe", seed=1, **kw), tiny_demo, root / "t"),
            save_family(build_random_model("qwen3_moe", seed=2, **kw), tiny_demo, root / "d"))


def test_sampled_tokens_follow_the_target_distribution(small_vocab_pair):
    """Temperature 0.4 (sharper than the random models' near-uniform logits) with a draft model (the rejection rule) and with prompt lookup (match):
    the empirical distributions of the second and third generated tokens (the first verify
    step's) agree with the target's exact marginals (chi-square, 3000 requests)."""
    target, draft = small_vocab_pair
    prompt, n, T = [*range(12), 3, 7], 3000, 0.4  # every token has a successor: lookup hits
    ref = LLM(target)
    p0 = torch.softmax(prompt_logits(ref, prompt)[-1] / T, -1)
    p1 = torch.zeros(12)
    p2 = torch.zeros(12)
    for a in range(12):
        step = torch.softmax(prompt_logits(ref, [*prompt, a])[-1] / T, -1)
        p1 += p0[a] * step
        for b in range(12):
            p2 += p0[a] * step[b] * torch.softmax(prompt_logits(ref, [*prompt, a, b])[-1] / T, -1)
    params = SamplingParams(temperature=T, max_tokens=4, ignore_eos=True)
    for mode in (str(draft), "ngram"):
        torch.manual_seed(0)
        llm = LLM(target, max_num_seqs=256, speculative=SpeculativeConfig(mode, 2))
        outs = llm.generate([prompt] * n, params)
        spec = llm.engine.spec_stats
        assert spec.num_drafts >= n and spec.num_draft_tokens > 1.5 * n  # k=2 at the 2nd step
        for pos, marginal in ((1, p1), (2, p2)):
            counts = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs]), minlength=12)
            expected = marginal.double() / marginal.double().sum() * n
            keep = expected >= 5  # chi-square's rule of thumb; the rest pooled
            observed, wanted = counts[keep].tolist(), expected[keep].tolist()
            if not keep.all():
                observed.append(counts[~keep].sum().item())
                wanted.append(expected[~keep].sum().item())
            assert stats.chisquare(observed, wanted).pvalue > 1e-3, (mode, pos)
        _assert_all_freed(llm)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(1, 3)
    assert drafter.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert drafter.lookup([5, 6, 5, 6], 4) == [5, 6]
    assert drafter.lookup([1, 2, 3], 3) == []


def test_truncate_releases_the_tail_blocks():
    tables = BlockTables(2, 8, torch.device("cpu"))
    manager = BlockManager(8, 4, tables)
    seq = Sequence("a", list(range(10)), SamplingParams(), 10)
    assert manager.allocate(seq, 10)
    seq.num_computed_tokens = 5
    manager.truncate(seq)
    assert len(seq.block_table) == 2 and manager.num_used_blocks == 2
    assert tables.tables[seq.table_row, 2:].eq(0).all()


def test_a_draft_with_another_vocabulary_is_refused(tiny_demo, small_vocab_pair):
    with pytest.raises(ModelError, match="vocabulary of 12 tokens"):
        LLM(tiny_demo, speculative=SpeculativeConfig(str(small_vocab_pair[1]), 3))
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        SpeculativeConfig("ngram", 0)


def test_preemption_and_more_requests_than_rows(tiny_demo):
    """A KV cache too small for every request preempts and recomputes sequences, and more
    requests pass through than the draft has block-table rows: still plain decoding's tokens,
    and every block back at the end."""
    kw = dict(max_num_seqs=2, max_model_len=96, block_size=16, num_kv_blocks=6)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    prompts = PROMPTS * 2
    want = [o.token_ids for o in LLM(tiny_demo, **kw).generate(prompts, params * 2)]
    llm = LLM(tiny_demo, **kw, speculative=SpeculativeConfig(str(tiny_demo), 3))
    assert [o.token_ids for o in llm.generate(prompts, params * 2)] == want
    assert llm.engine.scheduler.num_preempted_total > 0
    _assert_all_freed(llm)


def test_rejection_path_with_penalties_and_bias_runs_to_length(tiny_demo):
    """Unseeded sampling with penalties and a logit bias under a draft model goes through the
    rejection rule. With the target as its own draft, q and p are the same distributions when
    both are adjusted over the same tokens (proposals included), so min(1, p/q) keeps nearly
    every proposal; a mismatch in how either is built would reject many."""
    params = SamplingParams(temperature=0.9, top_p=0.95, presence_penalty=0.5,
                            frequency_penalty=0.3, logit_bias={13: 2.0}, max_tokens=40,
                            ignore_eos=True)
    llm = LLM(tiny_demo, speculative=SpeculativeConfig(str(tiny_demo), 4))
    outs = llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [40] * len(PROMPTS)
    spec = llm.engine.spec_stats
    assert spec.num_drafts > 0 and spec.acceptance_rate > 0.95
    assert sum(o.num_draft_tokens for o in outs) == spec.num_draft_tokens
    _assert_all_freed(llm)


def test_pacing_pauses_a_sequence_whose_proposals_fail_and_resumes_when_they_pay():
    pacing = Pacing()
    pacing.record(0)  # one failed verify: the recent mean (0.5) still pays
    assert pacing.proposes()
    pauses = []
    for _ in range(8):  # each further failure pauses, twice as long as the last, up to the cap
        pacing.record(0)
        skipped = 0
        while not pacing.proposes():
            skipped += 1
        pauses.append(skipped)
    assert pauses == [min(FIRST_PAUSE * 2**i, MAX_PAUSE) for i in range(8)]
    pacing.record(2)  # a probe that pays ends the pausing
    assert pacing.proposes() and pacing.proposes()
    pacing.record(0)
    pacing.record(0)
    skipped = 0
    while not pacing.proposes():
        skipped += 1
    assert skipped == FIRST_PAUSE


class _Rejected(NgramDrafter):
    """Proposes k copies of a token the target never chooses (its logit bias is -100)."""

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        return [BANNED] * k


BANNED = 13


@pytest.mark.parametrize("adaptive", [True, False])
def test_pacing_cuts_verifies_that_cannot_pay_and_keeps_the_tokens(tiny_demo, adaptive):
    """Every proposal fails: with pacing a sequence verifies a handful of times over 64 steps
    (a pause of 2, 4, 8... steps after each failure), without it at every step; the tokens are
    plain decoding's either way."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                            logit_bias={BANNED: -100.0})
    want = [o.token_ids for o in LLM(tiny_demo).generate(PROMPTS, params)]
    llm = LLM(tiny_demo, speculative=SpeculativeConfig("ngram", 3, adaptive=adaptive))
    llm.engine.drafter = _Rejected(1, 4)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    spec = llm.engine.spec_stats
    assert spec.num_accepted_tokens == 0
    if adaptive:
        assert spec.num_drafts <= 8 * len(PROMPTS)
    else:
        assert spec.num_drafts >= 60 * len(PROMPTS)
    _assert_all_freed(llm)
