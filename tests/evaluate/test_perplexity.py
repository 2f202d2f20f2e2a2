import math

import torch

from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import heldout_perplexity, perplexity
from thresher.models import load_model
from thresher.recipe import PerplexityConfig


def test_matches_hand_computation():
    """Two windows of 3 tokens over a 4-token vocabulary with fixed logits."""
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).expand(3, 4)
    windows = torch.tensor([[0, 1, 3], [2, 2, 0]])

    def fn(ids):
        return logits.expand(ids.shape[0], 3, 4)

    result = perplexity(fn, windows, batch_size=1, show_progress=False)
    # scored predictions: 1, 3 (window 0) and 2, 0 (window 1)
    nll = -(math.log(0.2) + math.log(0.4) + math.log(0.3) + math.log(0.1)) / 4
    assert result.tokens == 4 and result.windows == 2
    assert math.isclose(result.nll, nll, rel_tol=1e-6)
    assert math.isclose(result.perplexity, math.exp(nll), rel_tol=1e-6)
    assert "non-overlapping" in result.convention


def test_batching_does_not_change_the_result(tiny_demo, tiny_tokenizer):
    model = load_model(tiny_demo)
    windows = eval_windows(tiny_tokenizer, PerplexityConfig(seq_len=64, max_windows=6))
    a = perplexity(model, windows, batch_size=1, show_progress=False)
    b = perplexity(model, windows, batch_size=4, show_progress=False)
    assert math.isclose(a.perplexity, b.perplexity, rel_tol=1e-4)


def test_tiny_demo_model_learned(tiny_demo, tiny_tokenizer):
    """The trained tiny model is far better than uniform (vocab) on held-out files."""
    model = load_model(tiny_demo)
    windows = eval_windows(tiny_tokenizer, PerplexityConfig(seq_len=256, max_windows=64))
    result = perplexity(model, windows, show_progress=False)
    assert result.perplexity < model.config.vocab_size / 20, result


def test_heldout_perplexity_is_the_sequence_it_replaces(tiny_demo, tiny_tokenizer):
    """A model source and an already-loaded model give the numbers of the hand-written steps."""
    cfg = PerplexityConfig(seq_len=64, max_windows=4, batch_size=2)
    by_hand = perplexity(load_model(tiny_demo), eval_windows(tiny_tokenizer, cfg), batch_size=2,
                         show_progress=False)
    from_source = heldout_perplexity(str(tiny_demo), cfg, show_progress=False)
    loaded = heldout_perplexity(load_model(tiny_demo), cfg, tokenizer=tiny_tokenizer,
                                show_progress=False)
    assert from_source == by_hand and loaded == by_hand
