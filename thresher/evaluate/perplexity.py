"""Token-level perplexity on non-overlapping windows (the GPTQ / AWQ papers' convention).

The held-out text is tokenized once, cut into windows of ``seq_len`` tokens with the remainder
dropped, and every window is scored independently: ppl = exp(total NLL / tokens scored), where a
window of n tokens scores n - 1 predictions. This is not lm-evaluation-harness's word perplexity;
the result says which convention it used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from thresher.data.windows import WindowSplit, perplexity_windows
from thresher.recipe import PerplexityConfig

CONVENTION = "token-level, non-overlapping windows, remainder dropped"


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int
    seq_len: int
    convention: str = CONVENTION

    def as_dict(self) -> dict:
        return asdict(self)


LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def window_nll(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Summed NLL of each window's next-token predictions: logits [B, S, V], windows [B, S] -> [B]."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = windows[:, 1:].unsqueeze(-1)
    return -logprobs.gather(-1, target).squeeze(-1).sum(dim=-1)


@torch.no_grad()
def window_nlls(model: nn.Module | LogitsFn, windows: torch.Tensor, batch_size: int = 8,
                show_progress: bool = True) -> torch.Tensor:
    """Mean NLL per scored token of each window [N] (float64): the unit a paired comparison of
    two models on the same windows resamples."""
    if isinstance(model, nn.Module):
        model.eval()

        def logits_fn(ids: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids).logits
    else:
        logits_fn = model
    n, seq_len = windows.shape
    sums = [window_nll(logits_fn(windows[start : start + batch_size]),
                       windows[start : start + batch_size]).double()
            for start in tqdm(range(0, n, batch_size), desc="perplexity", unit="batch",
                              disable=not show_progress, leave=False)]
    return torch.cat(sums) / (seq_len - 1)


@torch.no_grad()
def perplexity(model: nn.Module | LogitsFn, windows: torch.Tensor, batch_size: int = 8,
               show_progress: bool = True) -> PerplexityResult:
    """Perplexity of ``model`` (a causal LM, or a function ids -> logits) on ``windows`` [N, S]."""
    n, seq_len = windows.shape
    nll = float(window_nlls(model, windows, batch_size, show_progress).mean())
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, tokens=n * (seq_len - 1),
                            windows=n, seq_len=seq_len)


def heldout_perplexity(model: str | Path | nn.Module, cfg: PerplexityConfig, tokenizer=None,
                       show_progress: bool = True, split: WindowSplit = "eval"
                       ) -> PerplexityResult:
    """Perplexity of a model on the held-out windows ``cfg`` names: the CLI, the flow and the
    benchmarks all score a model this way, so their numbers agree. ``split="tune"`` scores the
    tuning windows instead (``data.windows.tune_windows``), for a benchmark choosing a default.

    ``model`` is a source (hub id, local dir, ``models:/``, ``demo:size``), resolved and loaded
    here, or an already-loaded model with its ``tokenizer`` (a caller that also runs tasks on it).
    """
    from thresher.models.loading import check_window_length

    def check_windows(config) -> None:
        if config is not None:
            check_window_length(config, cfg.seq_len, "perplexity seq_len", "the model")

    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise TypeError("heldout_perplexity: a loaded model needs its tokenizer")
        check_windows(getattr(model, "config", None))
    else:
        from thresher.models import load_model, load_tokenizer, resolve_model
        from thresher.models.layerwise import load_config

        path = resolve_model(str(model))
        check_windows(load_config(path))  # before the weights are read
        tokenizer, model = load_tokenizer(path), load_model(path)
    return perplexity(model, perplexity_windows(tokenizer, cfg, split),
                      batch_size=cfg.batch_size, show_progress=show_progress)
