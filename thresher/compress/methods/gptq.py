"""GPTQ as a method: true-sequential Hessian capture per layer, then ``compress.gptq.GPTQ``.

Inside a layer the weights are quantized in GPTQ's true-sequential order (q/k/v, o, gate/up,
down), each stage's Hessians captured with the stages before it already quantized. A routed
expert's Hessian counts each of its routed tokens once (``expert_weighting: once``, as AutoGPTQ
and llm-compressor do), or weights it by its squared gate (``gate``: the expert's output enters
the layer output multiplied by the gate, and the objective is squared error), or, with
``expert_tokens: all``, counts every token of the batch once. The default ``auto`` gates at 2
bits and counts once at 3 and 4: on both demo models counting once won at 3 bits, was level at 4
and lost at 2 (docs/benchmarks.md). Gating aims the large 2-bit errors where the output feels
them; at 3 bits the Hessian's estimation noise, higher with fewer effective (Kish) tokens, weighs
more.

Rare experts: a Hessian estimated from n effective tokens over C columns has correlations that are
mostly noise when n is not much larger than C, and GPTQ then overfits the calibration tokens
(worse than RTN on held-out ones). With ``rare_expert_damping`` an expert's Hessian is blended
toward its diagonal by r = min(1, RARE_SHRINK * C / n): the dampening grows as tokens shrink, and
at r = 1 GPTQ is RTN on the same grid. Below ``min_expert_tokens`` effective tokens an expert
falls back to RTN outright.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, TypeVar

import torch

from thresher.compress.gptq import GPTQ, quantize_batch
from thresher.compress.methods.protocol import LayerJob, LayerRecord, grid_spec
from thresher.compress.rtn import rtn_quantize
from thresher.compress.targets import InputSite, Target, sequential_stages
from thresher.formats.gptq import GPTQ as GPTQ_FORMAT
from thresher.recipe import GPTQStage

log = logging.getLogger(__name__)

T = TypeVar("T")
GATED_BITS = 2  # expert_weighting auto: gate-weighted Hessians at this width and below
RARE_SHRINK = 0.1  # r = 0.1 C / n: full shrink (RTN) below 0.1 C effective tokens
# A layer's weights of one shape (its experts' gate and up, their down) run GPTQ's column loop
# together, up to this many bytes of fp32 weights and inverse-Hessian factors per batch: the loop
# launches a few kernels per column, ~30,000 for a 2048-column weight, once for the whole batch.
# On the CPU a column's work on a large matrix outweighs its dispatch, so batches stay small there
# (a whole layer of small experts still fits) and the quantize stage's peak memory stays put.
BATCH_BYTES = {"cpu": 32 << 20, "cuda": 1 << 30}


def rare_expert_shrink(columns: int, effective_tokens: float) -> float:
    """How far toward its diagonal an expert's Hessian is blended (0: not at all, 1: RTN)."""
    if effective_tokens <= 0:
        return 1.0
    return min(1.0, RARE_SHRINK * columns / effective_tokens)


class GPTQMethod:
    """GPTQ at one width, or (``bits: auto``) at the width ``widths`` gives each module, the
    others at ``base_bits`` (the allocation comes from ``compress.mixed``)."""

    name: ClassVar[str] = "gptq"
    format: ClassVar[str] = GPTQ_FORMAT.kind
    calibrated: ClassVar[bool] = True

    def __init__(self, stage: GPTQStage, widths: dict[str, int] | None = None,
                 base_bits: int | None = None, dynamic: dict[str, dict] | None = None):
        self.stage = stage
        self.widths = widths or {}
        self.dynamic = dynamic or {}
        self.bits = base_bits if base_bits is not None else (
            max(stage.auto_widths) if stage.bits == "auto" else stage.uniform_bits)
        self.grids = {b: grid_spec(b, stage.sym, self.format, stage.scale_search)
                      for b in {self.bits, *self.widths.values()}}
        self.grid = self.grids[self.bits]
        if stage.act_order and not stage.static_groups:
            log.warning("act_order without static_groups writes desc_act=true: vLLM refuses such "
                        "GPTQ checkpoints")

    def quantization_config(self, skip: list[str]) -> dict:
        st = self.stage
        return GPTQ_FORMAT.quantization_config(
            bits=self.bits, group_size=st.group_size, sym=self.grid.sym,
            desc_act=st.act_order and not st.static_groups, static_groups=st.static_groups,
            damp_percent=st.damp_percent, true_sequential=True, modules_to_not_convert=skip,
            dynamic=self.dynamic)

    def quantize_layer(self, job: LayerJob) -> None:
        st = self.stage
        for sites in sequential_stages(job.parts):
            hessians = self.site_hessians(job, sites)
            work: list[tuple[Target, GPTQ, float]] = []
            for site in sites:
                h = hessians.pop(site.name)
                fallback, shrink = self.site_rule(job.record, site, h)
                for t in site.targets:
                    bits = self.widths.get(t.key, self.bits)
                    if fallback:
                        job.commit(t, rtn_quantize(t.weight, self.grids[bits], st.group_size))
                    else:
                        work.append((t, h, shrink))
            chunks = column_loop_batches(
                work, lambda item: (item[0].weight, item[1],
                                    self.widths.get(item[0].key, self.bits)))
            for chunk in job.progress(chunks, f"layer {job.parts.idx} gptq"):
                grid = self.grids[self.widths.get(chunk[0][0].key, self.bits)]
                done = quantize_batch([(h, t.weight, shrink) for t, h, shrink in chunk], grid,
                                      st.group_size, st.act_order, st.static_groups,
                                      st.damp_percent, st.block_size)
                for (t, _, _), (q, loss) in zip(chunk, done, strict=True):
                    job.record.gptq_loss += loss
                    job.commit(t, q)

    def site_hessians(self, job: LayerJob, sites: list[InputSite]) -> dict[str, GPTQ]:
        """One capture of ``sites``' inputs into a Hessian each, on the weights' device (routed
        tokens, or every token with ``expert_tokens: all``)."""
        hessians = {s.name: GPTQ(s.columns, s.name, s.targets[0].weight.device) for s in sites}
        job.capture(sites, partial(_add_to_hessian, hessians, self.gated),
                    all_tokens=self.stage.expert_tokens == "all")
        return hessians

    @property
    def gated(self) -> bool:
        """Whether routed tokens enter an expert's Hessian with their gate squared: ``auto``
        gates at 2 bits, and with ``bits: auto`` (one Hessian for every width, as measured)."""
        weighting = self.stage.expert_weighting
        if weighting == "auto":
            return self.stage.bits == "auto" or self.bits <= GATED_BITS
        return weighting == "gate"

    def site_rule(self, record: LayerRecord, site: InputSite, h: GPTQ) -> tuple[bool, float]:
        """Whether the site falls back to RTN (too few tokens), and its rare-expert shrink."""
        st = self.stage
        n_eff = h.effective_tokens
        fallback = record.too_few_tokens(site, n_eff, st.min_expert_tokens)
        shrink = 0.0
        if site.expert is not None and st.rare_expert_damping and not fallback:
            shrink = rare_expert_shrink(site.columns, n_eff)
            record.expert_shrink[site.name] = shrink
        return fallback, shrink


def column_loop_batches(items: list[T], parts: Callable[[T], tuple[torch.Tensor, GPTQ, Any]]
                        ) -> list[list[T]]:
    """``items`` grouped into batches for one column loop each (``quantize_batch``): ``parts``
    gives an item's weight, Hessian and key (the width); a batch shares the weight shape, the
    Hessian's device (where the loop runs) and the key, and holds at most ``BATCH_BYTES`` of fp32
    weights and factors; the items' order is kept inside each batch."""
    groups: dict[tuple, list[T]] = {}
    for item in items:
        w, h, key = parts(item)
        groups.setdefault((*w.shape, h.H.device, key), []).append(item)
    batches = []
    for (rows, cols, device, _), group in groups.items():
        budget = BATCH_BYTES.get(torch.device(device).type, BATCH_BYTES["cuda"])
        per = max(1, budget // (4 * (rows * cols + cols * cols)))
        batches += [group[i:i + per] for i in range(0, len(group), per)]
    return batches


def _add_to_hessian(hessians: dict[str, GPTQ], gated: bool, site: InputSite,
                    x: torch.Tensor, gate: torch.Tensor | None) -> None:
    """A routed token counts once, or (``gated``) with its gate squared: the weight of its
    squared error in the layer's output."""
    hessians[site.name].add_batch(x, gate**2 if gated and gate is not None else None)
