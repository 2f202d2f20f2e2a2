"""Per-window NLLs and their paired comparison, on the trained tiny demo."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from thresher.compress.rtn import rtn_quantize
from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity, window_nlls
from thresher.evaluate.significance import PERPLEXITY_BLOCK, default_block, paired_perplexity
from thresher.models import load_model
from thresher.quant.grid import GridSpec
from thresher.recipe import PerplexityConfig


def test_window_nlls_average_to_the_perplexity(tiny_demo, tiny_tokenizer):
    model = load_model(tiny_demo)
    windows = eval_windows(tiny_tokenizer, PerplexityConfig(max_windows=6))
    nll = window_nlls(model, windows, batch_size=4, show_progress=False)
    assert nll.shape == (6,) and nll.dtype == torch.float64
    assert torch.allclose(nll, window_nlls(model, windows, batch_size=1,
                                           show_progress=False), atol=1e-5)
    ppl = perplexity(model, windows, batch_size=4, show_progress=False).perplexity  # same sums
    assert math.exp(float(nll.mean())) == pytest.approx(ppl, rel=1e-9)
    assert float(nll.std()) > 0.01  # windows differ: the spread pairing removes


def test_a_damaged_model_is_worse_beyond_noise_and_a_model_against_itself_is_not(
        tiny_demo, tiny_tokenizer):
    model = load_model(tiny_demo)
    windows = eval_windows(tiny_tokenizer, PerplexityConfig(max_windows=16))
    base = window_nlls(model, windows, show_progress=False)
    same = paired_perplexity(base.tolist(), base.tolist())
    assert same.ratio == (0.0, 0.0, 0.0) and same.better == 0 and not same.nll.beyond_noise
    with torch.no_grad():  # 2-bit RTN of every layer matrix: a real, consistent loss
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() >= 2:
                w = p.reshape(-1, p.shape[-1])
                p.copy_(rtn_quantize(w, GridSpec(bits=2, sym=False), 64).dequantize()
                        .reshape(p.shape))
    worse = window_nlls(model, windows, show_progress=False)
    d = paired_perplexity(base.tolist(), worse.tolist())
    assert d.nll.beyond_noise and d.nll.low > 0 and d.better <= 5
    lo, mid, hi = (d.ratio[1], d.ratio[0], d.ratio[2])
    assert 0 < lo <= mid <= hi
    assert mid == pytest.approx(math.exp(float(worse.mean() - base.mean())) - 1)
    assert d.describe() == (f"{100 * mid:+.3f}% [{100 * lo:+.3f}%, {100 * hi:+.3f}%] *, "
                            f"{d.better}/16 better")
    back = paired_perplexity(worse.tolist(), base.tolist())  # the other way round
    assert back.nll.high < 0 and back.better == int((base < worse).sum()) >= 11


def test_blocks_widen_the_interval_where_the_difference_drifts_along_the_text():
    """A difference that is +d over the first half of the windows and -d/2 over the second is
    beyond noise window by window; resampled in blocks of 16 consecutive windows it is not."""
    base = [3.0 + 0.01 * (i % 7) for i in range(64)]
    variant = [b + (0.004 if i < 32 else -0.002) + 0.0005 * (i % 3) for i, b in enumerate(base)]
    single = paired_perplexity(base, variant, block=1)
    blocked = paired_perplexity(base, variant, block=16)
    assert single.nll.beyond_noise and not blocked.nll.beyond_noise
    assert blocked.nll.delta == pytest.approx(single.nll.delta) and blocked.nll.n == 4
    assert single.better == blocked.better == 32
    assert paired_perplexity(base[:60], variant[:60], block=16).nll.n == 3  # remainder dropped
    with pytest.raises(ValueError, match="fewer than one block"):
        paired_perplexity(base[:8], variant[:8], block=16)
    with pytest.raises(ValueError, match="64 and 63 windows"):
        paired_perplexity(base, variant[:63])


def test_default_interval_resamples_blocks_of_neighbouring_windows():
    """Window differences that drift slowly along the text (an AR(1) with correlation 0.9
    between neighbours, as windows of one source file are alike): the default interval, over
    blocks of PERPLEXITY_BLOCK windows, is wider than the per-window one, which treats the
    windows as independent."""
    rng = np.random.default_rng(0)
    drift = np.zeros(64)
    for i in range(1, 64):
        drift[i] = 0.9 * drift[i - 1] + rng.normal(0, 0.01)
    base = 3.0 + 0.2 * rng.random(64)
    variant = base + 0.002 + drift
    blocked = paired_perplexity(base.tolist(), variant.tolist())
    single = paired_perplexity(base.tolist(), variant.tolist(), block=1)
    assert default_block(64) == PERPLEXITY_BLOCK == 8 and blocked.nll.n == 64 // 8
    assert blocked.nll.high - blocked.nll.low > 1.5 * (single.nll.high - single.nll.low)
    assert default_block(16) == 4 and default_block(7) == 1  # at least MIN_BLOCKS blocks
