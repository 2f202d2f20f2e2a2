"""lm-eval generation through the serving engine: KV cache and continuous batching.

The reference wrapper (``lm_wrapper.ThresherLM``) decodes one request at a time and re-runs the
whole sequence for every new token; a generative task of a few hundred prompts then takes tens of
minutes on the demo models. ``EngineLM`` hands all of a task's prompts to the engine's offline
``LLM`` at once, which prefills them in packed batches and decodes them together from a paged KV
cache. It keeps the reference's contract (greedy, the same context cut, the same stop rules), and
the tests check both give the same text. Log-likelihood requests (multiple-choice tasks) still go
through the reference wrapper's model, which the caller passes when such tasks are asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lm_eval.api.instance import Instance
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from thresher.evaluate.lm_wrapper import LogitsModel, ThresherLM
from thresher.serve_kernels import LLM, SamplingParams

log = logging.getLogger(__name__)


def _no_logits_model(*args, **kwargs):
    raise ValueError("this EngineLM was built without a logits model, so it only generates; "
                     "pass model=... to score multiple-choice (log-likelihood) tasks")


class EngineLM(ThresherLM):
    """``generate_until`` through an engine ``LLM``; scoring through ``model`` when given."""

    def __init__(self, llm: LLM | str | Path, model: LogitsModel | None = None, tokenizer=None,
                 batch_size: int = 16, max_gen_toks: int = 256, backend_name: str | None = None,
                 show_progress: bool = True, dtype: str = "float32") -> None:
        # a path is served in ``dtype``: float32, as thresher loads models for scoring, unless
        # given; never the engine's `auto`, which depends on the CPU's instruction set
        self.llm = llm if isinstance(llm, LLM) else LLM(llm, dtype=dtype)
        super().__init__(model if model is not None else _no_logits_model,
                         tokenizer if tokenizer is not None else self.llm.engine.tokenizer,
                         batch_size=batch_size, max_length=self.llm.engine.max_model_len,
                         max_gen_toks=max_gen_toks,
                         backend_name=backend_name or "thresher-engine",
                         show_progress=show_progress)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations of every request, decoded together by the engine."""
        eos_text = self.tok_decode([self.eot_token_id])
        prompts: list[list[int]] = []
        params: list[SamplingParams] = []
        stops: list[list[str]] = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("thresher's lm-eval engine backend decodes greedily; the task "
                                 f"asked for sampling ({gen_kwargs})")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
            max_new = int(kwargs["max_gen_toks"])
            prompts.append(self.tok_encode(context)[-max(1, self.max_length - max_new):])
            params.append(SamplingParams(temperature=0.0, max_tokens=max_new,
                                         stop=[s for s in until if s],
                                         stop_token_ids=[self.eot_token_id]))
            stops.append(until)
        texts: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}  # the engine takes one SamplingParams per call
        for i, p in enumerate(params):
            groups.setdefault((p.max_tokens, tuple(p.stop)), []).append(i)
        show = self.show_progress and not disable_tqdm
        for rows in groups.values():
            outputs = self.llm.generate([prompts[i] for i in rows], params[rows[0]],
                                        use_tqdm=show)
            for i, out in zip(rows, outputs, strict=True):
                texts[i] = postprocess_generated_text(out.text, stops[i], None)
        for request, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts  # type: ignore[return-value]
