"""Mixed precision under a size budget (``bits: auto``): per-matrix widths from measured damage.

Two passes over the model. The first (``SensitivityProbe``, driven by the same sequential
driver, committing nothing) captures every input site's GPTQ Hessian on the float model and
measures, for each candidate width b, the damage of quantizing the site's weights at b:

    D_b = tr((W - Q_b) S (W - Q_b)^T),   S = sum over the site's tokens of w_t x_t x_t^T,

the squared output error summed over the calibration tokens (GPTQ's layer-wise objective), with
Q_b what plain rounding (``sensitivity: rtn``, the default) or GPTQ at this stage's settings
(``gptq``, one GPTQ run per candidate width) gives.
S is the *unnormalized* Hessian: a routed expert's tokens count with their gate squared (its
output enters the layer output times the gate), so a hot expert's damage is larger by its routed
mass and it wins wider codes for that reason alone; an expert no calibration token reached has no
measured damage and gets the narrowest width. No separate hotness rule is needed, or added.

``allocate`` then picks one width per unit (the matrices of one site: q/k/v together, an expert's
gate/up together, a down projection alone; the groups vLLM fuses) minimizing the summed damage
under the bit budget: greedy along each unit's lower convex hull of (bits, damage), best damage
saved per bit first (the Lagrangian solution at every budget on the hull), then single-width
upgrades that still fit. The second pass is GPTQ at the chosen widths (``methods/gptq.py``).

Costs count every stored bit of a GPTQ v1 matrix (codes, fp16 scales, packed zeros, g_idx;
``formats.gptq.packed_bits``), the same way for every width, so ``target_bits`` t means "the size
of the quantized matrices at a uniform width t" and ``target_mb`` the size of the whole checkpoint.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field
from typing import ClassVar, NamedTuple

import torch

from thresher.compress.gptq import GPTQ, quantize_batch
from thresher.compress.methods.gptq import GPTQMethod, column_loop_batches
from thresher.compress.methods.protocol import LayerJob, Quantized
from thresher.compress.rtn import rtn_quantize
from thresher.compress.targets import sequential_stages
from thresher.errors import CompressionError
from thresher.formats import gptq as gptq_format
from thresher.recipe import GPTQStage


@dataclass
class Unit:
    """Matrices that share an input site and get one width."""

    name: str
    modules: list[str]
    shapes: list[tuple[int, int]]  # [out, in] of each module
    tokens: float = 0.0  # summed token weight the site's Hessian saw (gate^2 for experts)
    damage: dict[int, float] = field(default_factory=dict)  # width -> measured damage
    bits: int = 0  # the chosen width

    @property
    def weights(self) -> int:
        return sum(n * k for n, k in self.shapes)

    @classmethod
    def from_dict(cls, d: dict) -> Unit:
        """A unit as ``Allocation.summary`` wrote it (damage keys back to ints)."""
        return cls(d["name"], list(d["modules"]), [tuple(s) for s in d["shapes"]], d["tokens"],
                   {int(b): v for b, v in d["damage"].items()}, d["bits"])

    def cost(self, bits: float, group_size: int) -> float:
        return sum(gptq_format.packed_bits(n, k, bits, group_size) for n, k in self.shapes)


@dataclass
class Allocation:
    """The chosen width of every unit and what it adds up to."""

    units: list[Unit]
    group_size: int
    budget_bits: float
    target: str  # "target_bits=3.5" or "target_mb=1.2"

    def widths(self) -> dict[str, int]:
        return {m: u.bits for u in self.units for m in u.modules}

    @property
    def base_bits(self) -> int:
        """The width holding the most weights (``quantization_config.bits``; others are rules)."""
        share: dict[int, int] = {}
        for u in self.units:
            share[u.bits] = share.get(u.bits, 0) + u.weights
        return max(sorted(share), key=lambda b: share[b])

    def dynamic(self) -> dict[str, dict]:
        """GPTQModel's ``dynamic`` rules: one ``+:`` pattern per unit not at the base width."""
        base = self.base_bits
        return {gptq_format.module_pattern(u.modules): {"bits": u.bits}
                for u in self.units if u.bits != base}

    @property
    def average_bits(self) -> float:
        return sum(u.bits * u.weights for u in self.units) / sum(u.weights for u in self.units)

    @property
    def used_bits(self) -> float:
        return sum(u.cost(u.bits, self.group_size) for u in self.units)

    def damage(self) -> float:
        return sum(u.damage.get(u.bits, 0.0) for u in self.units)

    def summary(self) -> dict:
        """For the stage report: the totals, the weight share of each width, and every unit."""
        total = sum(u.weights for u in self.units)
        shares = {str(b): sum(u.weights for u in self.units if u.bits == b) / total
                  for b in sorted({u.bits for u in self.units})}
        return {"target": self.target, "average_bits": self.average_bits,
                "quantized_mb": self.used_bits / 8 / 2**20,
                "budget_mb": self.budget_bits / 8 / 2**20, "base_bits": self.base_bits,
                "estimated_damage": self.damage(), "weight_share": shares,
                "units": [{**asdict(u), "damage": {str(b): d for b, d in u.damage.items()}}
                          for u in self.units]}


def budget_bits(units: list[Unit], stage: GPTQStage, other_bits: float) -> tuple[float, str]:
    """The bits the quantized matrices may take, from the stage's target; ``other_bits`` are
    the checkpoint's tensors that stay in float (for ``target_mb``)."""
    if stage.target_bits is not None:
        return (sum(u.cost(stage.target_bits, stage.group_size) for u in units),
                f"target_bits={stage.target_bits:g}")
    assert stage.target_mb is not None
    return stage.target_mb * 2**20 * 8 - other_bits, f"target_mb={stage.target_mb:g}"


def allocate(units: list[Unit], candidates: list[int], group_size: int, budget: float) -> None:
    """Set each unit's ``bits`` to minimize the summed damage with the summed cost <= budget.

    Greedy by damage saved per bit along each unit's lower convex hull, then single upgrades
    that still fit, so what is left of the budget is smaller than any remaining upgrade."""
    widths = sorted(candidates)
    floor = sum(u.cost(widths[0], group_size) for u in units)
    if floor > budget * (1 + 1e-12):
        raise CompressionError(
            f"the budget ({budget / 8 / 2**20:.3f} MiB for the quantized matrices) is below "
            f"their size at {widths[0]} bits ({floor / 8 / 2**20:.3f} MiB); raise the target")
    left = budget - floor
    hulls = [_hull(u, widths, group_size) for u in units]
    pos = [0] * len(units)
    for u in units:
        u.bits = widths[0]
    heap = [(-_slope(h, 0), i) for i, h in enumerate(hulls) if len(h) > 1]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        h, p = hulls[i], pos[i]
        step = h[p + 1][1] - h[p][1]
        if step > left:
            continue  # this unit stays; cheaper upgrades are tried below
        left -= step
        pos[i] = p + 1
        units[i].bits = h[p + 1][0]
        if p + 2 < len(h):
            heapq.heappush(heap, (-_slope(h, p + 1), i))
    while True:  # fill: the best single upgrade that still fits
        best = None
        for u in units:
            for b in widths:
                if b <= u.bits:
                    continue
                step = u.cost(b, group_size) - u.cost(u.bits, group_size)
                gain = u.damage.get(u.bits, 0.0) - u.damage.get(b, 0.0)
                if step <= left and gain > 0 and (best is None or gain / step > best[0]):
                    best = (gain / step, u, b, step)
        if best is None:
            return
        _, u, b, step = best
        u.bits, left = b, left - step


def _hull(u: Unit, widths: list[int], group_size: int) -> list[tuple[int, float, float]]:
    """(width, cost, damage) on the lower convex hull from the narrowest width on, damage
    strictly falling: the widths a Lagrangian solution would ever pick for this unit."""
    points = [(b, u.cost(b, group_size), u.damage.get(b, 0.0)) for b in widths]
    hull = [points[0]]
    for pt in points[1:]:
        if pt[2] >= hull[-1][2]:
            continue  # costs more, saves nothing
        while len(hull) >= 2 and _slope_of(hull[-2], hull[-1]) <= _slope_of(hull[-2], pt):
            hull.pop()
        hull.append(pt)
    return hull


def _slope_of(a: tuple, b: tuple) -> float:
    """Damage saved per bit going from a to b."""
    return (a[2] - b[2]) / (b[1] - a[1])


def _slope(h: list[tuple], p: int) -> float:
    return _slope_of(h[p], h[p + 1])


def random_damage(units: list[Unit], candidates: list[int], seed: int) -> list[Unit]:
    """Copies of ``units`` with random falling damages: ``allocate`` on them gives a random
    allocation of the same budget (a control for the measured one)."""
    rng = random.Random(seed)
    out = []
    for u in units:
        scale = rng.random()
        damage = {b: scale * 2.0 ** -b for b in sorted(candidates)}
        out.append(Unit(u.name, list(u.modules), list(u.shapes), u.tokens, damage))
    return out


class SensitivityProbe:
    """The first pass: every site's damage at every candidate width; commits nothing, so each
    layer is measured on the float model's activations."""

    name: ClassVar[str] = "gptq sensitivity"
    calibrated: ClassVar[bool] = True

    def __init__(self, stage: GPTQStage, candidates: list[int]):
        self.stage = stage
        self.candidates = sorted(candidates)
        self.gptq = {b: GPTQMethod(stage, {}, base_bits=b) for b in self.candidates}
        self.units: list[Unit] = []

    def quantize_layer(self, job: LayerJob) -> None:
        rule = self.gptq[self.candidates[0]]
        st = self.stage
        for sites in sequential_stages(job.parts):
            hessians = rule.site_hessians(job, sites)
            work: list[_Probe] = []
            for site in sites:
                h = hessians.pop(site.name)
                fallback, shrink = rule.site_rule(job.record, site, h)
                unit = Unit(site.name, [t.key for t in site.targets],
                            [tuple(t.weight.shape) for t in site.targets], h.nsamples)
                self.units.append(unit)
                rtn = fallback or st.sensitivity != "gptq"
                S = h.H * (h.nsamples / 2)  # GPTQ keeps 2/n * sum(w x x^T)
                work += [_Probe(unit, h, S, t.weight, rtn, shrink) for t in site.targets]
            damages: dict[tuple[int, int], float] = {}  # (id of the probe, width) -> damage
            gptq = [p for p in work if not p.rtn]
            batches = [(b, chunk) for b in self.candidates
                       for chunk in column_loop_batches(gptq, lambda p: (p.weight, p.h, None))]
            for b, chunk in job.progress(batches, f"layer {job.parts.idx} sensitivity"):
                done = quantize_batch([(p.h, p.weight, p.shrink) for p in chunk],
                                      self.gptq[b].grid, st.group_size, st.act_order,
                                      st.static_groups, st.damp_percent, st.block_size)
                for p, (q, _) in zip(chunk, done, strict=True):
                    damages[id(p), b] = _damage(p.S, p.weight, q)
            for p in work:  # summed per unit in target order
                for b in self.candidates:
                    if p.rtn:
                        damages[id(p), b] = _damage(
                            p.S, p.weight, rtn_quantize(p.weight, self.gptq[b].grid,
                                                        st.group_size))
                    p.unit.damage[b] = p.unit.damage.get(b, 0) + damages[id(p), b]


class _Probe(NamedTuple):
    """One matrix the probe measures: its unit, the site's Hessian and its unnormalized sum S,
    the weight, whether it is rounded (RTN) instead of GPTQ'd, and the rare-expert shrink."""

    unit: Unit
    h: GPTQ
    S: torch.Tensor
    weight: torch.Tensor
    rtn: bool
    shrink: float


def _damage(S: torch.Tensor, w: torch.Tensor, q: Quantized) -> float:
    """err S err^T of a quantized weight, S the unnormalized Hessian sum(w x x^T)."""
    err = w.float() - q.dequantize()
    d = float(((err @ S) * err).sum())
    return d if math.isfinite(d) else float("inf")
