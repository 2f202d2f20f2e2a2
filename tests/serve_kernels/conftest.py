"""Shared helpers for the engine's tests: artifacts of every family, prompt logits of an engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.engine.sequence import Sequence


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The engine's ops are small: one intra-op thread avoids contention on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_family(model, tokenizer_dir: Path, out: Path) -> Path:
    """A transformers model saved as an artifact directory with the demo tokenizer."""
    from thresher.models import save_model

    save_model(model, None, out)
    for f in tokenizer_dir.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The engine's fp32 logits [len(ids), V] for a prompt, through the paged cache."""
    return prompt_pass(llm, ids)[0]


def prompt_pass(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's fp32 logits [len(ids), V] for a prompt and the experts each token was routed
    to in every MoE layer ([len(ids), layers, k], sorted per token)."""
    logits, routing, _ = routed_pass(llm, ids)
    return logits, routing


def routed_pass(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prompt_pass`` and each token's router margin in every MoE layer ([len(ids), layers]):
    the gap between its k-th and (k+1)-th best router logit over its largest |logit|. Where it
    is small, another implementation's rounding may route the token to the other expert."""
    engine = llm.engine
    routed: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []
    moe = [layer.mlp for layer in engine.runner.model.layers if hasattr(layer.mlp, "experts")]

    def margin(mlp, logits: torch.Tensor) -> None:
        if mlp.rule is not None:  # a biased or grouped choice: no margin on the logits alone
            margins.append(torch.full(logits.shape[:1], float("nan")))
            return
        logits = logits.float()
        top = logits.topk(mlp.top_k + 1, -1).values  # softmax keeps the logits' order
        margins.append((top[:, -2] - top[:, -1]) / logits.abs().amax(-1))

    hooks = [mlp.experts.register_forward_pre_hook(
                 lambda _m, args: routed.append(args[2].sort(-1).values)) for mlp in moe]
    hooks += [mlp.router.register_forward_hook(lambda _m, _a, out, mlp=mlp: margin(mlp, out))
              for mlp in moe]
    seq = Sequence("probe", ids, SamplingParams(max_tokens=1), 1)
    assert engine.block_manager.allocate(seq, len(ids))
    try:
        hidden, _ = engine.runner.hidden_states(ScheduledBatch([seq], [len(ids)]))
        routing = (torch.stack(routed, 1) if routed  # a dense family routes nothing
                   else torch.zeros(len(ids), 0, 0, dtype=torch.long))
        gaps = torch.stack(margins, 1) if margins else torch.zeros(len(ids), 0)
        return engine.runner.model.logits(hidden), routing, gaps
    finally:
        engine.block_manager.free(seq)
        for hook in hooks:
            hook.remove()


ROUTER_TIE = 0.02  # a router margin below this share of the logits' scale is a near-tie


def assert_logits_track(got: tuple[torch.Tensor, torch.Tensor],
                        ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """``prompt_pass`` of a bf16 kernel against ``routed_pass`` of the fp32 reference: every
    token routed as the reference routes it and every token before it has logits within 2% of
    their scale. A token whose top-k choice sits at a near-tie may be routed to another expert
    in one of the two, which moves its logits, its later layers' routing and, through the keys
    and values, the later tokens' (measured: 2.4% of the scale two tokens on); so the first
    token routed elsewhere must be at a near-tie of the reference's router in the first layer
    where it was, and it and the tokens after it are exempt."""
    (got_logits, got_routing), (ref_logits, ref_routing, margins) = got, ref
    differs = (got_routing != ref_routing).any(-1)  # [tokens, layers]
    elsewhere = differs.any(1).nonzero()
    first = int(elsewhere[0]) if len(elsewhere) else len(differs)
    if first < len(differs):
        layer = int(differs[first].nonzero()[0])
        assert margins[first, layer] < ROUTER_TIE, (f"token {first} routed elsewhere in layer "
                                                    f"{layer} past a near-tie: {margins[first, layer]}")
    if first:
        diff = (got_logits - ref_logits)[:first]
        assert diff.abs().max() < 0.02 * ref_logits.abs().max()


def assert_tracks_reference(llm: LLM, prompts: list[list[int]], fast: list[list[int]],
                            fast_passes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A fast kernel's greedy tokens, teacher-forced through the path now in force (the
    reference): logits as ``assert_logits_track`` says, each chosen token the best or within 1%
    of it (a near-tie may flip between bf16 kernels and the fp32 reference)."""
    for prompt, tokens, got in zip(prompts, fast, fast_passes, strict=True):
        ref = routed_pass(llm, prompt + tokens)
        assert_logits_track(got, ref)
        steps = ref[0][len(prompt) - 1: -1]  # the logits that chose each generated token
        assert_chosen_near_best(steps, tokens, 0.01 * ref[0].abs().max())


def assert_chosen_near_best(steps: torch.Tensor, tokens: list[int], tie: torch.Tensor) -> None:
    """Each token of a greedy continuation is the best of its step's logits [n, V] or within
    ``tie`` of it (a near-tie that another implementation's rounding may break the other way)."""
    chosen = steps.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert ((steps.max(1).values - chosen) < tie).all()
