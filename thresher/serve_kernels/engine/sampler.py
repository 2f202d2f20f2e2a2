"""Next-token choice for a batch of rows, each with its own sampling parameters.

Rows with a ``logit_bias`` or a presence/frequency penalty first have their logits adjusted
(OpenAI's formula: minus ``frequency x count + presence x [count > 0]`` over the tokens generated
so far). Greedy rows then take the argmax. The others divide by their temperature, mask
everything outside their top-k and their top-p nucleus (one sort for the rows that ask for
either) and below their min-p share of the most likely token, and draw from the softmax: rows
with a seed from their own generator (so a seeded request samples the same tokens whatever else
is in the batch), the rest in one batched draw. Log-probs are those of the model's own
distribution (log-softmax of the raw logits), as vLLM returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thresher.serve_kernels.engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens, when any row asked
    top_logprobs: list[dict[int, float] | None] | None


def _restrict(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf. logits [R, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = rank >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _adjust(logits: torch.Tensor, params: list[SamplingParams],
            output_ids: list[list[int]] | None) -> torch.Tensor:
    """The logits with each row's logit_bias added and its penalties subtracted (a copy)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device,
                                dtype=logits.dtype)
            logits[i].index_add_(0, ids, bias)
        if (p.presence_penalty or p.frequency_penalty) and output_ids and output_ids[i]:
            counts = torch.bincount(torch.tensor(output_ids[i], device=logits.device),
                                    minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


class Sampler:
    """Samples one token per row of fp32 logits [R, V]."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 output_ids: list[list[int]] | None = None) -> SampleResult:
        """``output_ids``: each row's generated tokens so far (needed only for penalties)."""
        rows = logits.shape[0]
        raw = logits
        if any(p.adjusts_logits for p in params):
            logits = _adjust(logits, params, output_ids)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        if not random:  # the common all-greedy batch: one argmax, no gathers or scatters
            chosen = logits.argmax(dim=-1)
        else:
            chosen = torch.empty(rows, dtype=torch.long, device=logits.device)
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                chosen[idx] = logits[idx].argmax(dim=-1)
            chosen[torch.tensor(random, device=logits.device)] = self._sample(
                logits, [params[i] for i in random], [generators[i] for i in random], random)
        token_ids = chosen.tolist()

        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            return SampleResult(token_ids, None, None)
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen_lp = logprobs.gather(-1, chosen[:, None]).squeeze(-1).tolist()
        top: list[dict[int, float] | None] = [None] * rows
        n_top = max(w or 0 for w in want)
        if n_top:
            values, ids = logprobs.topk(n_top, dim=-1)
            for i, w in enumerate(want):
                if w:
                    top[i] = dict(zip(ids[i, :w].tolist(), values[i, :w].tolist(), strict=True))
        return SampleResult(token_ids, chosen_lp, top)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], rows: list[int]) -> torch.Tensor:
        device = logits.device
        x = logits[torch.tensor(rows, device=device)]
        temps = torch.tensor([p.temperature for p in params], device=device)
        x = x / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            vocab = x.shape[-1]
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=x.dtype)
            x = _restrict(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
            floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        out = torch.empty(len(rows), dtype=torch.long, device=device)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        for i in seeded:
            gen = generators[i]
            row = probs[i] if gen.device == probs.device else probs[i].to(gen.device)
            out[i] = torch.multinomial(row, 1, generator=gen)[0]
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            out[idx] = torch.multinomial(probs[idx], 1).squeeze(-1)
        return out
