"""The validation run: engine perplexity, greedy agreement with the base, the HTTP load test."""

from __future__ import annotations

import math

import pytest
import torch

from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity
from thresher.models import load_model, load_tokenizer, save_model
from thresher.recipe import PerplexityConfig, ValidateConfig
from thresher.serve_kernels import LLM
from thresher.serve_kernels.draft_score import draft_acceptance
from thresher.serve_kernels.validate import engine_perplexity, token_agreement, validate_artifact

EVAL = PerplexityConfig(seq_len=64, max_windows=4)
VALIDATE = ValidateConfig(concurrency=[1, 4], max_tokens=12, rounds=1)


@pytest.fixture(scope="module")
def noisy_artifact(tiny_demo, tmp_path_factory):
    """The tiny demo with noise on its decoder weight matrices: a worse model of the same shape."""
    model = load_model(tiny_demo)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 2.0)
    out = tmp_path_factory.mktemp("noisy") / "noisy"
    save_model(model, load_tokenizer(tiny_demo), out)
    return out


def test_token_agreement():
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == (1.0, 1.0)
    full, prefix = token_agreement([[1, 9, 3, 4], [5, 6]], [[1, 2, 3, 4], [7, 6]])
    assert full == pytest.approx(4 / 6)
    assert prefix == pytest.approx((1 / 4 + 0 / 2) / 2)


def test_engine_perplexity_matches_transformers(tiny_demo, tiny_tokenizer):
    windows = eval_windows(tiny_tokenizer, EVAL)
    want = perplexity(load_model(tiny_demo), windows, show_progress=False)
    ppl, nll, tokens = engine_perplexity(LLM(tiny_demo, dtype="float32"), windows.tolist())
    assert tokens == want.tokens
    assert math.isclose(ppl, want.perplexity, rel_tol=1e-3)
    assert math.isclose(nll, want.nll, rel_tol=1e-3)


@pytest.mark.slow
def test_validate_base_and_degraded_variant(tiny_demo, noisy_artifact):
    base = validate_artifact(tiny_demo, tiny_demo, EVAL, VALIDATE)
    noisy = validate_artifact(noisy_artifact, tiny_demo, EVAL, VALIDATE)
    assert base["validate/agreement"] == 1.0 and base["validate/agreement_prefix"] == 1.0
    assert noisy["validate/agreement"] < 0.95
    assert noisy["validate/agreement_prefix"] <= noisy["validate/agreement"]
    assert noisy["validate/perplexity"] > base["validate/perplexity"] * 1.05
    for m in (base, noisy):
        for c in VALIDATE.concurrency:
            assert m[f"validate/throughput_c{c}_tok_s"] > 0
            assert 0 < m[f"validate/ttft_p50_ms_c{c}"] <= m[f"validate/ttft_p99_ms_c{c}"]
            assert 0 < m[f"validate/tpot_p50_ms_c{c}"] <= m[f"validate/tpot_p99_ms_c{c}"]
        assert all(math.isfinite(v) for v in m.values())


def test_draft_acceptance_scores_a_draft_of_a_target(tiny_demo):
    """A model drafting for itself at temperature 0 has every proposal kept; prompt lookup on
    the same prompts keeps fewer."""
    itself = draft_acceptance(tiny_demo, tiny_demo, max_tokens=24, num_speculative_tokens=3)
    assert itself.acceptance_rate == 1.0 and itself.mean_accepted_length == pytest.approx(4.0,
                                                                                          abs=0.5)
    assert itself.num_draft_tokens > 0 and itself.tokens_per_second > 0
    lookup = draft_acceptance(tiny_demo, "ngram", max_tokens=24, num_speculative_tokens=3)
    assert 0 < lookup.acceptance_rate < 1
    assert set(lookup.metrics()) == {"validate/draft_acceptance_rate",
                                     "validate/draft_mean_accepted_length",
                                     "validate/speculative_tokens_per_s"}
