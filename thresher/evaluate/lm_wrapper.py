"""An lm-evaluation-harness model over any causal LM thresher can load.

lm-eval's own ``hf`` backend loads the model itself; thresher needs to score models it has already
built in memory (a dequantized GPTQ artifact, a pruned model, a deliberately damaged control, the
serving engine), so this wrapper asks only for ``model(input_ids=ids).logits`` and a tokenizer.
Sequences in a batch are right-padded and no attention mask is passed: in a causal model the
padding after a sequence cannot change the logits of the tokens before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

LogitsModel = nn.Module | Callable[..., Any]
DEFAULT_MAX_LENGTH = 2048


class ThresherLM(TemplateLM):
    """Scores and greedy-generates text with ``model``; batches of ``batch_size`` sequences."""

    def __init__(self, model: LogitsModel, tokenizer, batch_size: int = 16,
                 max_length: int | None = None, max_gen_toks: int = 256,
                 backend_name: str | None = None, show_progress: bool = True) -> None:
        super().__init__()
        if isinstance(model, nn.Module):
            model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self._max_length = max_length or _model_max_length(model)
        self.max_gen_toks = max_gen_toks
        self.backend_name = backend_name or type(model).__name__
        self.show_progress = show_progress
        eot = tokenizer.eos_token_id
        if eot is None:
            eot = tokenizer.bos_token_id
        if eot is None:
            raise ValueError("the tokenizer has neither an eos nor a bos token to condition on")
        self._eot = int(eot)

    # --- what TemplateLM asks for -----------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split (encode the whole, cut at the context's length), except where a BPE
        merge across the boundary leaves no continuation token: then encode the two apart."""
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        if not continuation_enc:
            context_enc = self.tok_encode(context)
            continuation_enc = self.tok_encode(continuation)
        return context_enc, continuation_enc

    @torch.no_grad()
    def _logprobs(self, sequences: list[list[int]]) -> torch.Tensor:
        """Log-softmax over the vocabulary for each position of right-padded ``sequences``."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self._eot, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        logits = self.model(input_ids=ids).logits
        return torch.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Sum of continuation log-probs given the context, and whether greedy decoding agrees.

        The context is cut from the left so context + continuation fits ``max_length``; requests
        run longest first, so each batch pads little and a too-long input fails at once.
        """
        scored: list[tuple[list[int], int]] = []  # (input tokens, continuation length)
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked to score an empty continuation")
            whole = (context + continuation)[-(self.max_length + 1):]
            scored.append((whole[:-1], len(continuation)))
        order = sorted(range(len(scored)), key=lambda i: -len(scored[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(scored)
        bar = tqdm(total=len(order), desc="loglikelihood", unit="req", leave=False,
                   disable=disable_tqdm or not self.show_progress)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            logprobs = self._logprobs([scored[i][0] for i in batch])
            for row, i in enumerate(batch):
                inputs, n_cont = scored[i]
                target = torch.tensor(requests[i][2][-n_cont:], dtype=torch.long)
                positions = logprobs[row, len(inputs) - n_cont : len(inputs)]
                total = float(positions.gather(-1, target.unsqueeze(-1)).sum())
                greedy = bool((positions.argmax(-1) == target).all())
                results[i] = (total, greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Instance],
                              disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, in disjoint windows of up to ``max_length`` tokens."""
        out: list[float] = []
        for request in tqdm(requests, desc="loglikelihood_rolling", leave=False,
                            disable=disable_tqdm or not self.show_progress):
            (text,) = request.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id,
                                                   self.max_length, context_len=1)
            ]
            pairs = [(("", ""), ctx, cont) for ctx, cont in windows]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(pairs, disable_tqdm=True))
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    @torch.no_grad()
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding until a stop string, the eos token or ``max_gen_toks`` new tokens.

        The model is re-run on the whole sequence at each step (no KV cache), since the wrapper
        assumes nothing beyond ``model(input_ids=...).logits``.
        """
        eos_text = self.tok_decode([self.eot_token_id])
        out: list[str] = []
        for request in tqdm(requests, desc="generate_until", leave=False,
                            disable=disable_tqdm or not self.show_progress):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("thresher's lm-eval wrapper decodes greedily; the task asked "
                                 f"for sampling ({gen_kwargs})")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
            max_new = int(kwargs["max_gen_toks"])
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]
            new: list[int] = []
            for _ in range(max_new):
                next_id = int(self._logprobs([ids + new])[0, -1].argmax())
                if next_id == self.eot_token_id:
                    break
                new.append(next_id)
                if any(stop and stop in self.tok_decode(new) for stop in until):
                    break
            text = postprocess_generated_text(self.tok_decode(new), until, None)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def get_model_info(self) -> dict[str, Any]:
        """Added by lm-eval to its results' config block."""
        return {"backend": self.backend_name, "max_length": self.max_length}


def _model_max_length(model: LogitsModel) -> int:
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else DEFAULT_MAX_LENGTH
