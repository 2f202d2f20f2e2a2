"""Sampler and stop conditions, on the tiny demo model and on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.sampler import Sampler, exponential_noise, row_key
from thresher.serve_kernels.engine.sampling_params import InvalidSamplingParam
from thresher.serve_kernels.engine.sequence import Snapshot


@pytest.fixture(scope="module")
def llm(tiny_demo):
    return LLM(tiny_demo)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)
    alone = llm.generate("def main():", p)[0].token_ids
    crowd = llm.generate(["import os", "def main():", "class A:"], p)[1].token_ids
    assert alone == crowd
    other = llm.generate("def main():", SamplingParams(temperature=1.0, max_tokens=24, seed=8,
                                                       ignore_eos=True))[0].token_ids
    assert other != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate("import os\n", SamplingParams(temperature=0, max_tokens=16,
                                                        ignore_eos=True))[0].token_ids
    for p in (SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16, ignore_eos=True)):
        assert llm.generate("import os\n", p)[0].token_ids == greedy


def test_top_k_and_top_p_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    sampler = Sampler()
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = logits[0].softmax(-1).sort(descending=True)
    nucleus = set(probs.indices[: int((probs.values.cumsum(0) < 0.6).sum()) + 1].tolist())
    seen_k, seen_p, seen_all = set(), set(), set()
    for _ in range(300):
        seen_k.add(sampler(logits, [SamplingParams(top_k=5)], [0]).token_ids[0])
        seen_p.add(sampler(logits, [SamplingParams(top_p=0.6)], [0]).token_ids[0])
        seen_all.add(sampler(logits, [SamplingParams()], [0]).token_ids[0])
    assert seen_k <= top5 and len(seen_k) >= 4
    assert seen_p <= nucleus and len(seen_p) >= len(nucleus) - 1
    assert not seen_all <= top5 | nucleus


def test_logprobs_are_the_models_and_top_n_includes_the_choice(llm):
    out = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                                     ignore_eos=True))[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 8
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3 and max(top, key=top.get) == tok  # greedy picks the top token
        assert top[tok] == pytest.approx(lp) and lp <= 0
    # the same log-probs come back as prompt log-probs when the output is fed back in
    ids = out.prompt_token_ids + out.token_ids
    scored = llm.score([ids])[0]
    assert scored[len(out.prompt_token_ids):] == pytest.approx(out.logprobs, abs=1e-4)


def test_stop_strings_cut_the_text_and_stop_tokens_end_generation(llm, tiny_tokenizer):
    free = llm.generate("class Foo(object):", SamplingParams(temperature=0, max_tokens=40,
                                                             ignore_eos=True))[0]
    text = free.text
    stop = text[10:14]
    assert stop.strip()
    cut = llm.generate("class Foo(object):", SamplingParams(temperature=0, max_tokens=40,
                                                            ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) < len(free.token_ids)
    token = free.token_ids[5]
    by_id = llm.generate("class Foo(object):", SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[token]))[0]
    end = free.token_ids.index(token)
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: end + 1]
    # the ending token's text is left out, as vLLM does (and as end-of-sequence's is)
    assert by_id.text == tiny_tokenizer.decode(free.token_ids[:end], skip_special_tokens=True)
    short = llm.generate("class Foo(object):", SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_streamed_text_only_grows(llm):
    engine = llm.engine
    engine.add_request("s", "def main():", SamplingParams(temperature=0, max_tokens=30,
                                                          ignore_eos=True, stop=["zzzz"]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.text for o in engine.step() if o.request_id == "s"]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


def test_sampling_params_are_checked():
    for field, bad in (("temperature", -1), ("temperature", math.inf), ("top_p", 1.5),
                       ("min_p", -0.1), ("top_k", -2), ("max_tokens", 0), ("stop", [""]),
                       ("presence_penalty", 2.5), ("frequency_penalty", math.nan),
                       ("logit_bias", {3: 1e30}), ("logit_bias", {-1: 1.0}),
                       ("seed", 2**64), ("seed", -(2**63) - 1), ("repetition_penalty", 0.0),
                       ("repetition_penalty", 11.0), ("repetition_penalty", math.inf),
                       ("min_tokens", -1), ("min_tokens", 17)):
        with pytest.raises(InvalidSamplingParam) as err:
            SamplingParams(**{field: bad})
        assert err.value.field == field
    SamplingParams(top_p=0, top_k=0, min_p=1, seed=2**64 - 1)  # the edges are valid
    for field, bad in (("top_k", 4097), ("logit_bias", {4096: 1.0})):
        with pytest.raises(InvalidSamplingParam) as err:
            SamplingParams(**{field: bad}).check_vocab(4096)
        assert err.value.field == field


def test_temperature_below_epsilon_is_greedy(llm):
    greedy = llm.generate("import os\n", SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))[0].token_ids
    for t in (1e-300, 1e-45, 1e-6):
        p = SamplingParams(temperature=t, max_tokens=8, ignore_eos=True)
        assert p.greedy and llm.generate("import os\n", p)[0].token_ids == greedy


def test_logit_bias_penalties_and_min_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    sampler = Sampler()
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [greedy], [0]).token_ids == [0]
    biased = SamplingParams(temperature=0, logit_bias={3: 100.0})
    assert sampler(logits, [biased], [0]).token_ids == [3]
    # token 0 generated twice: 3 - 2 x 0.8 - 0.5 = 0.9 < 2, so token 1 wins
    penalized = SamplingParams(temperature=0, frequency_penalty=0.8, presence_penalty=0.5)
    assert sampler(logits, [penalized], [0], [[0, 0]]).token_ids == [1]
    # min_p 1 keeps only the most likely token, whatever the temperature
    top_only = SamplingParams(temperature=2.0, min_p=1.0)
    assert {sampler(logits, [top_only], [0]).token_ids[0] for _ in range(50)} == {0}
    # the log-probs stay the model's own
    out = sampler(logits, [SamplingParams(temperature=0, logit_bias={3: 100.0}, logprobs=0)],
                  [0])
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 3].item())


def test_seeded_rows_draw_the_same_tokens_in_any_batch_company():
    """A seeded row's token depends on its seed, position and probabilities only: alone, or at
    another index among greedy, unseeded and other seeded rows, it draws the same token."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 2
    sampler = Sampler()
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=1234)
    company = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
               SamplingParams(temperature=1.2, seed=99), SamplingParams(top_p=0.5, seed=7),
               SamplingParams(temperature=0, logprobs=2)]
    for position in range(40):
        alone = sampler(logits[2:3], [seeded], [position]).token_ids[0]
        params = [*company[:2], seeded, *company[2:]]
        positions = [position + 3 * i for i in range(len(params))]
        positions[2] = position
        crowd = sampler(logits, params, positions).token_ids
        assert crowd[2] == alone, position
        greedy = logits.argmax(-1).tolist()
        assert crowd[0] == greedy[0] and crowd[5] == greedy[5]  # greedy rows unchanged


def test_different_seeds_differ_and_a_seed_samples_the_distribution():
    """Over positions, one seed's draws follow the softmax (and respect top-k); another seed
    draws a different sequence."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sampler = Sampler()
    n = 3000
    draws = {seed: [sampler(logits, [SamplingParams(seed=seed)], [k]).token_ids[0]
                    for k in range(n)] for seed in (11, 12)}
    assert draws[11] != draws[12]
    freq = torch.bincount(torch.tensor(draws[11]), minlength=6).float() / n
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.03
    top2 = {sampler(logits, [SamplingParams(top_k=2, seed=5)], [k]).token_ids[0]
            for k in range(200)}
    assert top2 == {0, 1}


def test_seeded_noise_is_a_pure_function_of_seed_and_position():
    keys = [row_key(7, 0), row_key(7, 1), row_key(8, 0), row_key(-1, 0), row_key(2**64 - 1, 0)]
    a = exponential_noise(keys, 5000, torch.device("cpu"))
    b = exponential_noise(keys[::-1], 5000, torch.device("cpu")).flip(0)
    assert torch.equal(a, b)
    assert row_key(-1, 0) == row_key(2**64 - 1, 0)  # the same 64 bits, as manual_seed reads them
    assert len({tuple(r[:8].tolist()) for r in a[:3]}) == 3
    assert (a > 0).all() and abs(a.mean().item() - 1.0) < 0.02  # Exp(1): mean 1


def test_repetition_penalty_and_min_tokens_on_fixed_logits():
    """vLLM's repetition penalty over the prompt and the output (a positive logit divided, a
    negative one multiplied), and min_tokens masking end-of-sequence and the stop tokens."""
    logits = torch.tensor([[3.0, 2.5, -1.0, -1.2]])
    sampler = Sampler(eos_token_ids=[0])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 only in the prompt: 3 / 2 = 1.5 < 2.5, so token 1 wins
    assert sampler(logits, [p], [0], [Snapshot([0, 3], 2)]).token_ids == [1]
    # among {2, 3}: both seen, -2 > -2.4, token 2 stays; token 2 alone seen (in the prompt):
    # -1 x 2 = -2 < -1.2, token 3 wins
    masked = logits.clone()
    masked[0, :2] = float("-inf")
    assert sampler(masked, [p], [1], [Snapshot([3, 2], 2)]).token_ids == [2]
    assert sampler(masked, [p], [1], [Snapshot([2], 1)]).token_ids == [3]
    assert sampler(masked, [SamplingParams(temperature=0)], [1], [[2]]).token_ids == [2]
    # min_tokens: eos (0) and the stop token (1) masked while fewer than 2 tokens are out
    q = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sampler(logits, [q], [1], [Snapshot([2, 2], 1)]).token_ids == [2]
    assert sampler(logits, [q], [2], [Snapshot([2, 2, 2], 1)]).token_ids == [0]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, [ignore], [0], [Snapshot([2], 1)]).token_ids == [0]


def test_min_tokens_holds_off_every_stop(llm):
    """A stop token and a stop string that end the greedy text early wait for min_tokens; the
    text up to then is the free run's."""
    free = llm.generate("class Foo(object):", SamplingParams(temperature=0, max_tokens=40,
                                                             ignore_eos=True))[0]
    token = free.token_ids[3]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[token],
                       min_tokens=12)
    out = llm.generate("class Foo(object):", p)[0]
    assert token not in out.token_ids[:11] and len(out.token_ids) >= 12
    assert out.token_ids[:3] == free.token_ids[:3]
    stop = free.text[2:5]
    early = llm.generate("class Foo(object):", SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=20))[0]
    assert len(early.token_ids) >= 20 and early.token_ids[:20] == free.token_ids[:20]


def test_repetition_penalty_changes_greedy_text_and_one_is_off(llm):
    base = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    free = llm.generate("for i in range(10):\n    ", base)[0].token_ids
    off = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.0)
    assert llm.generate("for i in range(10):\n    ", off)[0].token_ids == free
    hard = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=3.0)
    penalized = llm.generate("for i in range(10):\n    ", hard)[0].token_ids
    assert penalized != free
    assert len(set(penalized)) > len(set(free))  # fewer repeats
