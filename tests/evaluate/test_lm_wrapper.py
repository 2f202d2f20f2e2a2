"""ThresherLM against lm-eval's own hf backend and against direct computation on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from lm_eval.api.instance import Instance

from thresher.evaluate.lm_wrapper import ThresherLM
from thresher.models import load_model

PAIRS = [
    ("def add(a, b):\n    return", " a + b"),
    ("import os\nimport", " sys"),
    ("class Foo:\n    def __init__(self", "):\n        self.x = 1"),
    ("for i in range(10):\n", "    print(i)"),
    ("x = [1, 2, 3", "]"),
]


@pytest.fixture(scope="module")
def tiny_model(tiny_demo):
    return load_model(tiny_demo)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_matches_lm_eval_hf_backend(tiny_model, tiny_tokenizer):
    from lm_eval.models.huggingface import HFLM

    ours = ThresherLM(tiny_model, tiny_tokenizer, batch_size=2, show_progress=False)
    theirs = HFLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=2)
    a = ours.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    b = theirs.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a, b, strict=True):
        assert math.isclose(ll_a, ll_b, rel_tol=1e-4, abs_tol=1e-4)
        assert greedy_a == greedy_b
    assert all(ll < 0 for ll, _ in a)


def test_loglikelihood_is_the_sum_of_next_token_logprobs(tiny_model, tiny_tokenizer):
    """Checked by hand for one pair, and independent of how requests are batched."""
    lm = ThresherLM(tiny_model, tiny_tokenizer, batch_size=1, show_progress=False)
    context, continuation = PAIRS[0]
    ctx = tiny_tokenizer.encode(context, add_special_tokens=False)
    whole = tiny_tokenizer.encode(context + continuation, add_special_tokens=False)
    with torch.no_grad():
        logprobs = torch.log_softmax(tiny_model(input_ids=torch.tensor([whole])).logits[0], -1)
    expected = sum(float(logprobs[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
    (got, _), = lm.loglikelihood(_requests("loglikelihood", [PAIRS[0]]), disable_tqdm=True)
    assert math.isclose(got, expected, rel_tol=1e-5)
    batched = ThresherLM(tiny_model, tiny_tokenizer, batch_size=5, show_progress=False)
    one_by_one = lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    together = batched.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    for (x, gx), (y, gy) in zip(one_by_one, together, strict=True):
        assert math.isclose(x, y, rel_tol=1e-4) and gx == gy


def test_rolling_loglikelihood_over_several_windows(tiny_model, tiny_tokenizer):
    """A text longer than max_length is scored in disjoint windows; every token exactly once."""
    text = "".join(a + b + "\n" for a, b in PAIRS) * 3
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    lm = ThresherLM(tiny_model, tiny_tokenizer, batch_size=4, max_length=32, show_progress=False)
    full = ThresherLM(tiny_model, tiny_tokenizer, batch_size=4, show_progress=False)
    assert len(ids) > 3 * 32
    windowed = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), True)[0]
    whole = full.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), True)[0]
    with torch.no_grad():
        seq = torch.tensor([[tiny_tokenizer.eos_token_id, *ids]])
        logprobs = torch.log_softmax(tiny_model(input_ids=seq).logits[0, :-1], -1)
    direct = float(logprobs.gather(-1, seq[0, 1:, None]).sum())
    assert math.isclose(whole, direct, rel_tol=1e-4)
    assert windowed < 0 and windowed != pytest.approx(whole, rel=1e-6)  # less context per token


def test_generate_until_is_greedy_and_stops(tiny_model, tiny_tokenizer):
    lm = ThresherLM(tiny_model, tiny_tokenizer, show_progress=False)
    prompt = "def main():\n    "
    (text,) = lm.generate_until(
        _requests("generate_until", [(prompt, {"until": ["\n"], "max_gen_toks": 12})]), True)
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = tiny_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    reference = tiny_tokenizer.decode(out[0, len(ids):]).split("\n")[0]
    reference = reference.split(tiny_tokenizer.eos_token)[0]
    assert "\n" not in text
    assert text == reference
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until(_requests("generate_until", [(prompt, {"do_sample": True})]), True)
