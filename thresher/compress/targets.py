"""What gets quantized in a decoder layer, in which order, and which input each weight reads.

Everything here is derived from the family adapter (no branching on model names): the attention
projections (q/k/v/o, or latent attention's q_a/q_b/kv_a/kv_b/o), the dense MLP, each routed expert's gate/up/down (views into transformers' fused
expert tensors, named by their hub-canonical per-expert keys), and Qwen2-MoE's shared expert. The
router and the shared-expert gate always stay in 16 bits.

- ``sequential_stages``: GPTQ's true-sequential order (the adapter's attention stages, then
  gate/up, then down),
  each stage a list of input sites whose weights share one Hessian.
- ``scaling_groups``: AWQ's groups, each a set of weights that read one input, the operation
  before them that absorbs the inverse scale, and the float weights that read the same input and
  must be compensated (the router) so the model is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from thresher.models.adapters import Adapter
from thresher.models.checkpoint import canonical_layer_state

# Parts of a model that ``keep_16bit`` may name.
ALWAYS_16BIT = ("router", "embeddings", "lm_head")
OPTIONAL_16BIT = ("attention", "shared_expert")


@dataclass
class Target:
    """One weight matrix to quantize."""

    key: str  # hub-canonical module name (no ".weight"), the prefix of its packed tensors
    weight: torch.Tensor  # live view [out, in] of the layer's parameter; overwritten in place
    role: str  # the attention projection's name (q_proj, kv_b_proj, ...), gate, up, down
    expert: int | None = None


@dataclass
class InputSite:
    """Targets that read the same input (one GPTQ Hessian, one set of AWQ statistics).

    ``module`` is the nn.Linear whose input is the site's input, or the fused experts module,
    whose forward receives (hidden, top_k_index, top_k_weights): then ``expert`` selects the
    routed tokens, and ``down`` asks for the down projection's input act(gate x) * up x.
    """

    name: str
    targets: list[Target]
    module: nn.Module
    expert: int | None = None
    down: bool = False

    @property
    def columns(self) -> int:
        return self.targets[0].weight.shape[1]


@dataclass
class ScalingGroup:
    """AWQ: weights scaled by s along their inputs; the op before them absorbs 1/s.

    ``inspect`` is where the output error of a candidate scale is measured: "attention" (the
    attention block on the norm output), "module" (``site.module``'s parent block given as
    ``block``), or "linear" (the targets themselves on the site's input, gate-weighted for experts).
    A ``tokenwise`` block (an MLP or MoE block: each token's output depends on that token alone)
    runs on the captured batches merged into a few calls.
    """

    name: str
    site: InputSite
    inspect: str
    block: nn.Module | None = None
    prev_norm: nn.Module | None = None
    norm_offset: float = 0.0  # prev_norm multiplies by (norm_offset + weight): Qwen3.5's 1
    prev_weight: torch.Tensor | None = None  # [C, in]: rows divided by s
    prev_bias: torch.Tensor | None = None
    compensate: list[torch.Tensor] = field(default_factory=list)  # [*, C]: multiplied by s
    tokenwise: bool = False

    @property
    def targets(self) -> list[Target]:
        return self.site.targets


def _disk_key(adapter: Adapter, layer_idx: int, rel: str) -> str:
    """Hub-canonical name of a module given its name relative to the decoder layer."""
    (key,) = canonical_layer_state(adapter, layer_idx, {f"{rel}.weight": torch.empty(0)})
    return key.removesuffix(".weight")


class LayerParts:
    """The quantizable pieces of one decoder layer, as the adapter describes them."""

    def __init__(self, adapter: Adapter, layer: nn.Module, layer_idx: int, keep_16bit: set[str]):
        self.adapter = adapter
        self.layer = layer
        self.idx = layer_idx
        self.keep = keep_16bit
        self._names = {id(m): n for n, m in layer.named_modules()}
        self.moe = adapter.is_moe_layer(layer)
        self.attn = adapter.attention_projections(layer)
        self.shared = adapter.shared_expert(layer) if self.moe else None
        self.dense = None if self.moe else adapter.dense_mlp_projections(layer)

    def linear(self, module: nn.Linear, role: str) -> Target:
        key = _disk_key(self.adapter, self.idx, self._names[id(module)])
        return Target(key=key, weight=module.weight.data, role=role)

    def expert(self, e: int, role: str) -> Target:
        view = getattr(self.adapter.expert_view(self.layer, e), role)
        return Target(key=self.adapter.disk_expert_key(self.idx, e, role), weight=view, role=role,
                      expert=e)

    def shared_projections(self) -> dict[str, nn.Linear] | None:
        if self.shared is None or "shared_expert" in self.keep:
            return None
        return {"gate_proj": self.shared.gate_proj, "up_proj": self.shared.up_proj,
                "down_proj": self.shared.down_proj}

    @property
    def num_experts(self) -> int:
        return self.adapter.experts(self.layer).gate_up_proj.shape[0] if self.moe else 0

    def experts_module(self) -> nn.Module:
        return self.adapter.experts(self.layer)


def sequential_stages(parts: LayerParts) -> list[list[InputSite]]:
    """GPTQ's true-sequential order inside a layer: attention stages (q/k/v then o; MLA: q_a/kv_a,
    q_b and kv_b, o), gate/up, down."""
    stages: list[list[InputSite]] = []
    p = f"layer {parts.idx}"
    if "attention" not in parts.keep:
        a = parts.attn
        for sites in parts.adapter.attention_sites(parts.layer):
            stages.append([InputSite(f"{p} {site.label}",
                                     [parts.linear(a[n], n) for n in site.projections],
                                     a[site.projections[0]]) for site in sites])
    mlp_in: list[InputSite] = []
    mlp_out: list[InputSite] = []
    for label, projs in (("mlp", parts.dense), ("shared expert", parts.shared_projections())):
        if projs is None:
            continue
        gate, up, down = projs["gate_proj"], projs["up_proj"], projs["down_proj"]
        mlp_in.append(InputSite(f"{p} {label} gate/up",
                                [parts.linear(gate, "gate"), parts.linear(up, "up")], gate))
        mlp_out.append(InputSite(f"{p} {label} down", [parts.linear(down, "down")], down))
    experts = parts.experts_module() if parts.moe else None
    for e in range(parts.num_experts):
        mlp_in.append(InputSite(f"{p} expert {e} gate/up",
                                [parts.expert(e, "gate"), parts.expert(e, "up")], experts, expert=e))
        mlp_out.append(InputSite(f"{p} expert {e} down", [parts.expert(e, "down")], experts,
                                 expert=e, down=True))
    return [s for s in (*stages, mlp_in, mlp_out) if s]


def all_targets(parts: LayerParts) -> list[Target]:
    return [t for stage in sequential_stages(parts) for site in stage for t in site.targets]


def scaling_groups(parts: LayerParts) -> list[ScalingGroup]:
    """AWQ's scaling groups of a layer, in the order they are searched and applied."""
    groups: list[ScalingGroup] = []
    stages = sequential_stages(parts)
    sites = {s.name: s for stage in stages for s in stage}
    p = f"layer {parts.idx}"
    adapter, layer = parts.adapter, parts.layer
    if "attention" not in parts.keep:
        attn = adapter.attention(layer)
        first, *inner, _ = adapter.attention_sites(layer)
        # a Gated DeltaNet has no positions: its whole block is inspected like an MLP, and its
        # 16-bit input projections are compensated like a router
        inspect = "attention" if adapter.attention_takes_positions(layer) else "module"
        groups.append(ScalingGroup(f"{p} {first[0].label}", sites[f"{p} {first[0].label}"],
                                   inspect, block=attn, prev_norm=adapter.input_norm(layer),
                                   norm_offset=adapter.norm_weight_offset,
                                   compensate=[m.weight.data for m in
                                               adapter.attention_float_inputs(layer)]))
        for site in (s for stage in inner for s in stage if s.norm):  # MLA's low-rank norms
            groups.append(ScalingGroup(f"{p} {site.label}", sites[f"{p} {site.label}"], "linear",
                                       prev_norm=getattr(attn, site.norm)))
        # o_proj's input folds into v_proj's rows, not with GQA (nor MLA, nor a DeltaNet's
        # out_proj, whose gated norm shares one weight across heads)
        v, o = parts.attn.get("v_proj"), parts.attn.get("o_proj")
        if v is not None and o is not None and v.weight.shape[0] == o.weight.shape[1]:
            groups.append(ScalingGroup(f"{p} o_proj", sites[f"{p} o_proj"], "linear",
                                       prev_weight=v.weight.data,
                                       prev_bias=None if v.bias is None else v.bias.data))
    # gate/up of every expert (and the dense or shared MLP) read the post-attention norm
    mlp_in = [t for s in sites.values() if s.name.endswith("gate/up") for t in s.targets]
    compensate = []
    if parts.moe:
        compensate.append(adapter.router(layer).weight.data)
        shared_gate = adapter.shared_expert_gate(layer)
        if shared_gate is not None:
            compensate.append(shared_gate.weight.data)
        if parts.shared is not None and "shared_expert" in parts.keep:
            compensate += [parts.shared.gate_proj.weight.data, parts.shared.up_proj.weight.data]
    mlp = adapter.mlp(layer)
    groups.append(ScalingGroup(f"{p} mlp gate/up", InputSite(f"{p} mlp input", mlp_in, mlp),
                               "module", block=mlp, prev_norm=adapter.post_attention_norm(layer),
                               norm_offset=adapter.norm_weight_offset, compensate=compensate,
                               tokenwise=True))
    for site in sites.values():
        if site.name.endswith(" down") and (site.expert is None
                                            or adapter.expert_up_absorbs_scales):
            up = _up_weight_of(parts, site)
            groups.append(ScalingGroup(site.name, site, "linear", prev_weight=up))
    return groups


def _up_weight_of(parts: LayerParts, site: InputSite) -> torch.Tensor:
    """The up projection whose output rows feed ``site``'s down projection."""
    if site.expert is not None:
        return parts.adapter.expert_view(parts.layer, site.expert).up
    if parts.dense is not None and site.module is parts.dense["down_proj"]:
        return parts.dense["up_proj"].weight.data
    return parts.shared.up_proj.weight.data


@torch.no_grad()
def apply_scale(group: ScalingGroup, s: torch.Tensor) -> None:
    """Scale the group's weights by s along their inputs and fold 1/s into the op before them;
    weights that read the same input but stay in float (the router) are multiplied by s too, so
    the float model, and therefore every routing decision, is unchanged."""
    if group.prev_norm is not None:
        offset = group.norm_offset
        group.prev_norm.weight.data.add_(offset).div_(s).sub_(offset)
    if group.prev_weight is not None:
        group.prev_weight.div_(s.unsqueeze(1))
    if group.prev_bias is not None:
        group.prev_bias.div_(s)
    for t in group.targets:
        t.weight.mul_(s)
    for w in group.compensate:
        w.mul_(s)
