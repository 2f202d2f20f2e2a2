"""AWQ as a method: per layer, search each scaling group's scale on captured inputs, fold it in,
optionally search clipping ranges, then round to nearest (``compress.awq`` holds the math).

Folding a scale leaves the float layer unchanged, so one capture of the layer serves every
scaling group. A candidate scale is judged by the output error of the group's block: the
attention on the input norm's output, the MLP, or, for o_proj and down, the projection itself,
gate-weighted for a routed expert (with ``expert_tokens: all``, every token, ungated). An expert
with fewer than ``min_expert_tokens`` effective (gate-weighted) tokens is left unscaled and
unclipped.

With ``select_on: heldout`` the captured calibration batches are split: the scale's activation
means come from the even batches and alpha is chosen by the block's output error on the odd ones;
the clip ranges are searched on the even batches and a group keeps its shrink only if it is no
worse than no clipping on the odd ones. A site whose routed tokens all fall in one part is fitted
and judged on all of them, as with ``fit``.

4-bit AWQ writes the AWQ gemm format; other widths write the GPTQ format (the scales are already
folded into the weights, so the codes are plain grouped integers either way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from thresher.compress.awq import (
    clip_weight,
    search_clip,
    search_scale,
    weight_mean,
)
from thresher.compress.methods.protocol import LayerJob, grid_spec
from thresher.compress.rtn import rtn_quantize
from thresher.compress.targets import (
    InputSite,
    ScalingGroup,
    all_targets,
    apply_scale,
    scaling_groups,
    sequential_stages,
)
from thresher.formats.awq import AWQ, BITS
from thresher.formats.gptq import GPTQ
from thresher.formats.registry import format_for
from thresher.models.adapters import SCORE_PROJECTIONS
from thresher.quant.rtn import quantize_dequantize
from thresher.recipe import AWQStage

Inputs = tuple[list[torch.Tensor], list[torch.Tensor | None]]  # per batch: inputs, expert gates
TOKENWISE_TOKENS = 8192  # tokens a token-wise block runs at once (bounds its intermediates)


class AWQMethod:
    name: ClassVar[str] = "awq"
    calibrated: ClassVar[bool] = True

    def __init__(self, stage: AWQStage):
        self.stage = stage
        self.format = AWQ.kind if stage.bits == BITS else GPTQ.kind
        self.grid = grid_spec(stage.bits, stage.sym, self.format)
        self.all_tokens = stage.expert_tokens == "all"
        self.heldout = stage.select_on == "heldout"

    def quantization_config(self, skip: list[str]) -> dict:
        st = self.stage
        fields = {
            AWQ.kind: dict(group_size=st.group_size, modules_to_not_convert=skip),
            # No Hessian: the GPTQ-only fields get the values of a plain, in-order GPTQ checkpoint.
            GPTQ.kind: dict(bits=st.bits, group_size=st.group_size, sym=st.sym, desc_act=False,
                            static_groups=True, damp_percent=0.01, true_sequential=False,
                            modules_to_not_convert=skip),
        }
        return format_for(self.format).quantization_config(**fields[self.format])

    def quantize_layer(self, job: LayerJob) -> None:
        groups = scaling_groups(job.parts)
        inputs = _capture(job, [g.site for g in groups], self.all_tokens)
        for group in job.progress(groups, f"layer {job.parts.idx} awq"):
            self._scale(job, group, *inputs.pop(group.site.name))
        if self.stage.clip:
            self._clip(job)
        for t in all_targets(job.parts):
            job.commit(t, rtn_quantize(t.weight, self.grid, self.stage.group_size))

    def _scale(self, job: LayerJob, group: ScalingGroup, xs: list[torch.Tensor],
               gates: list[torch.Tensor | None]) -> None:
        """Search the group's scale and fold it into the layer."""
        if job.record.too_few_tokens(group.site, _effective_tokens(xs, gates),
                                     self.stage.min_expert_tokens):
            return
        gs = self.stage.group_size
        (fit_xs, _), (held_xs, held_gates) = _split(xs, gates, self.heldout)
        x_mean = torch.cat([x.reshape(-1, group.site.columns) for x in fit_xs]).abs().mean(dim=0)
        targets = group.targets
        w_mean = weight_mean([t.weight for t in targets], gs)
        inspect = _inspector(job, group, held_xs, held_gates)
        reference = inspect()
        originals = [t.weight.clone() for t in targets]

        def loss(s: torch.Tensor) -> float:
            for t, w in zip(targets, originals, strict=True):
                t.weight.copy_(quantize_dequantize(w * s, self.grid, gs) / s)
            err = (inspect() - reference).pow(2).mean()
            for t, w in zip(targets, originals, strict=True):
                t.weight.copy_(w)
            return float(err)

        best = search_scale(x_mean, w_mean, loss, self.stage.duo_scaling)
        job.record.awq_alpha[group.name] = best.alpha
        apply_scale(group, best.scale)

    def _clip(self, job: LayerJob) -> None:
        """Search each weight's clipping range on its (scaled) input; projections that make
        attention scores (queries, keys) are left unclipped."""
        sites = [s for stage in sequential_stages(job.parts) for s in stage]
        inputs: dict[str, list[torch.Tensor]] = {s.name: [] for s in sites}

        def keep(site: InputSite, x: torch.Tensor, gate: torch.Tensor | None) -> None:
            x = x.reshape(-1, site.columns).float()
            inputs[site.name].append(x if gate is None else x * gate.unsqueeze(1))

        job.capture(sites, keep, all_tokens=self.all_tokens)
        for site in job.progress(sites, f"layer {job.parts.idx} awq clip"):
            if site.expert is not None and site.expert in job.record.fallback_experts:
                continue
            xs = inputs.pop(site.name)
            (fit, _), (held, _) = _split(xs, [None] * len(xs), self.heldout)
            x = torch.cat(fit)
            check = torch.cat(held) if held is not fit else None
            for t in site.targets:
                if t.role in SCORE_PROJECTIONS:
                    continue
                max_val = search_clip(t.weight, x, self.grid, self.stage.group_size,
                                      check=check)
                t.weight.copy_(clip_weight(t.weight, max_val, self.stage.group_size))


def _split(xs: list[torch.Tensor], gates: list[torch.Tensor | None],
           heldout: bool) -> tuple[Inputs, Inputs]:
    """(fit, held-out) parts of a site's batches: even and odd batches with ``heldout`` when both
    parts have tokens, else the same lists twice."""
    if heldout:
        fit, held = (xs[0::2], gates[0::2]), (xs[1::2], gates[1::2])
        if all(sum(x.reshape(-1, x.shape[-1]).shape[0] for x in part[0]) for part in (fit, held)):
            return fit, held
    return (xs, gates), (xs, gates)


def _effective_tokens(xs: list[torch.Tensor], gates: list[torch.Tensor | None]) -> float:
    """Kish's (sum g)^2 / sum g^2 over a site's gates: its token count when ungated."""
    if gates[0] is None:
        return float(sum(x.reshape(-1, x.shape[-1]).shape[0] for x in xs))
    g = torch.cat([t for t in gates if t is not None])
    return float(g.sum() ** 2 / g.pow(2).sum()) if g.numel() else 0.0


def _capture(job: LayerJob, sites: list[InputSite], all_tokens: bool) -> dict[str, Inputs]:
    """Every site's inputs (per batch, or per batch of routed tokens) and expert gates."""
    captured: dict[str, Inputs] = {s.name: ([], []) for s in sites}

    def keep(s: InputSite, x: torch.Tensor, gate: torch.Tensor | None) -> None:
        captured[s.name][0].append(x.float())
        captured[s.name][1].append(gate)

    job.capture(sites, keep, all_tokens=all_tokens)
    return captured


def _inspector(job: LayerJob, group: ScalingGroup, xs: list[torch.Tensor],
               gates: list[torch.Tensor | None]) -> Callable[[], torch.Tensor]:
    """A function computing the group's output on the captured inputs with current weights."""
    if group.inspect == "attention":
        attn = group.block
        pes = [job.position_embeddings(x) for x in xs]
        masks = [job.attention_mask(x) for x in xs]

        def run_attention() -> torch.Tensor:
            return torch.cat([attn(hidden_states=x, position_embeddings=pe,
                                   attention_mask=mask)[0].reshape(-1, x.shape[-1])
                              for x, pe, mask in zip(xs, pes, masks, strict=True)])
        return run_attention
    if group.inspect == "module":
        block = group.block
        if group.tokenwise:  # few calls, not one per batch (each launches kernels on a GPU)
            xs = merge_batches(xs, TOKENWISE_TOKENS)

        def run_block() -> torch.Tensor:
            outs = [block(x) for x in xs]  # gpt-oss's MLP also returns its router scores
            outs = [out[0] if isinstance(out, tuple) else out for out in outs]
            return torch.cat([out.reshape(-1, x.shape[-1]) for out, x in zip(outs, xs,
                                                                             strict=True)])
        return run_block
    x = torch.cat([x.reshape(-1, group.site.columns) for x in xs])
    gate = None if gates[0] is None else torch.cat(gates).unsqueeze(1)

    def run_linear() -> torch.Tensor:
        y = torch.cat([x @ t.weight.T for t in group.targets], dim=1)
        return y if gate is None else y * gate
    return run_linear


def merge_batches(xs: list[torch.Tensor], limit: int) -> list[torch.Tensor]:
    """Consecutive batches joined along the tokens ([1, tokens, C]) into calls of at most
    ``limit`` tokens; a batch larger than that is a call of its own."""
    calls: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    tokens = 0
    for x in (x.reshape(1, -1, x.shape[-1]) for x in xs):
        if run and tokens + x.shape[1] > limit:
            calls.append(torch.cat(run, dim=1))
            run, tokens = [], 0
        run.append(x)
        tokens += x.shape[1]
    if run:
        calls.append(torch.cat(run, dim=1))
    return calls
