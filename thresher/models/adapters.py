"""Architecture adapters: where a family keeps its layers, attention, router and experts.

Family quirks live here and nowhere else. The rest of thresher asks an adapter for "the router
of layer 3" or "expert 5's up projection" and never branches on a model name.

transformers 5 keeps MoE experts fused as 3-D parameters (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); hub checkpoints and vLLM use per-expert names. An adapter
gives per-expert views of the fused tensors and the canonical on-disk names of each expert.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from thresher.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ExpertWeights:
    """Views (not copies) of one expert's matrices, in nn.Linear layout [out, in]."""

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]


@dataclass(frozen=True)
class Routing:
    """The router's decision for a batch of tokens, as the model's forward computes it."""

    logits: torch.Tensor  # [T, E] raw router logits
    probs: torch.Tensor  # [T, E] fp32 scores: softmax over all experts, or sigmoid (GLM-4.5)
    top_k_index: torch.Tensor  # [T, k] selected experts
    top_k_weights: torch.Tensor  # [T, k] gate values the forward pass multiplies expert outputs by


@dataclass(frozen=True)
class RoutingRule:
    """How one router turns logits into (gate values, experts): everything needed to recompute
    its decision for any subset of the experts without running the model.

    ``softmax``: softmax over the experts, top-k, renormalized if ``renormalize``; with a
    ``bias`` (ERNIE-4.5), experts are selected on the softmax plus the bias and gated by the
    softmax alone.
    ``topk_softmax`` (gpt-oss): top-k of the raw logits, then softmax over the k selected.
    ``sigmoid`` (GLM-4.5, DeepSeek-V3): sigmoid scores; experts are *selected* on the scores plus
    the score-correction ``bias``, within the ``topk_group`` best of ``n_group`` groups (a group
    ranked by its two best biased scores); the gate values are the unbiased scores of the
    selected experts, renormalized if ``renormalize``, times ``scaling``.
    """

    top_k: int
    renormalize: bool
    scoring: str = "softmax"
    bias: torch.Tensor | None = None  # [E] selection-only score correction
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits.sigmoid() if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)

    def select(self, logits: torch.Tensor, kept: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate values and expert indices [T, k] from raw ``logits`` [T, E]; with ``kept`` [E]
        (bool), as the pruned checkpoint computes them (the others removed; a pruned grouped
        router has its group limit dropped, see ``Adapter.set_num_experts``). ``bias`` stands
        in for the rule's own (a module's buffer, on the logits' device)."""
        pruned = kept is not None and not bool(kept.all())
        if self.scoring == "topk_softmax":
            if pruned:
                logits = logits.masked_fill(~kept, float("-inf"))
            top, index = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top.float(), dim=-1), index
        bias = self.bias if bias is None else bias
        if self.scoring == "softmax":
            if pruned:
                logits = logits.masked_fill(~kept, float("-inf"))
            scores = self.scores(logits)
            if bias is None:
                weights, index = torch.topk(scores, self.top_k, dim=-1)
            else:  # removed experts score 0, so they are masked again after the bias
                choice = scores + bias.to(scores.device).float()
                if pruned:
                    choice = choice.masked_fill(~kept, float("-inf"))
                index = torch.topk(choice, self.top_k, dim=-1)[1]
                weights = scores.gather(-1, index)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, index
        scores = self.scores(logits)
        choice = scores if bias is None else scores + bias.to(scores.device).float()
        if pruned:
            choice = choice.masked_fill(~kept, float("-inf"))
        elif self.n_group > 1:
            per_group = choice.shape[-1] // self.n_group
            grouped = choice.view(-1, self.n_group, per_group)
            best = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
            chosen = torch.zeros_like(best, dtype=torch.bool)
            chosen.scatter_(1, best.topk(self.topk_group, dim=-1)[1], True)
            choice = choice.masked_fill(~chosen.repeat_interleave(per_group, dim=1),
                                        float("-inf"))
        index = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(-1, index)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, index


@dataclass(frozen=True)
class FamilySpec:
    """The facts that differ between families; everything else is shared."""

    model_types: tuple[str, ...]
    moe: bool
    num_experts_key: str = "num_experts"
    disk_moe_prefix: str = "mlp"  # where experts live in hub checkpoints (Mixtral: block_sparse_moe)
    disk_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: bool = False
    shared_expert_name: str = "shared_expert"  # GLM-4.5: shared_experts
    always_renormalize: bool = False  # the forward renormalizes top-k regardless of config
    router: str = "softmax"  # or "sigmoid", "topk_softmax": see RoutingRule
    router_correction: str | None = None  # the router's selection-only bias (GLM-4.5)
    # config key counting extra trailing layers (multi-token prediction) that thresher drops
    extra_layers_key: str | None = None
    dense_layers_key: str | None = None  # config key counting the dense layers before the MoE ones
    attention: str = "mha"  # or "mla": multi-head latent attention (DeepSeek-V3), see MLA_SITES
    fp32_router: bool = False  # the forward computes the router's logits in fp32 (GLM-4.5)


_GLM4_MOE = FamilySpec(
    ("glm4_moe",),
    moe=True,
    num_experts_key="n_routed_experts",
    shared_expert=True,
    shared_expert_name="shared_experts",
    router="sigmoid",
    router_correction="e_score_correction_bias",
    fp32_router=True,
    extra_layers_key="num_nextn_predict_layers",
    dense_layers_key="first_k_dense_replace",
)

FAMILIES: dict[str, FamilySpec] = {
    "qwen3_moe": FamilySpec(("qwen3_moe",), moe=True),
    "qwen2_moe": FamilySpec(("qwen2_moe",), moe=True, shared_expert=True),
    "mixtral": FamilySpec(
        ("mixtral",),
        moe=True,
        num_experts_key="num_local_experts",
        disk_moe_prefix="block_sparse_moe",
        disk_expert_names=("w1", "w3", "w2"),
        always_renormalize=True,
    ),
    "olmoe": FamilySpec(("olmoe",), moe=True),
    # GLM-4.5: sigmoid router with score correction and groups, dense first layers, an always-on
    # shared expert, and a multi-token-prediction layer after the decoder (dropped: it only
    # serves speculative decoding, and transformers' forward does not run it).
    "glm4_moe": _GLM4_MOE,
    # DeepSeek-V3 (and Kimi-K2, the same architecture): GLM-4.5's router, dense first layers and
    # shared experts, with multi-head latent attention.
    "deepseek_v3": replace(_GLM4_MOE, model_types=("deepseek_v3",), attention="mla"),
    # gpt-oss: biased router with softmax after top-k, fused experts with biases and a clamped
    # SwiGLU, attention sinks and alternating sliding-window layers (models/gpt_oss.py).
    "gpt_oss": FamilySpec(
        ("gpt_oss",),
        moe=True,
        num_experts_key="num_local_experts",
        router="topk_softmax",
    ),
    # ERNIE-4.5-MoE: softmax router whose selection adds a score-correction bias (``moe_statics``,
    # [1, E] beside the router on the hub), gates renormalized always; dense first layers and
    # always-on shared experts (models/ernie.py).
    "ernie4_5_moe": FamilySpec(
        ("ernie4_5_moe",),
        moe=True,
        num_experts_key="moe_num_experts",
        shared_expert=True,
        shared_expert_name="shared_experts",
        always_renormalize=True,
        router_correction="e_score_correction_bias",
        fp32_router=True,
    ),
    # Qwen3.5-MoE: Gated DeltaNet and gated full-attention layers, softmax router renormalized
    # always, a sigmoid-gated shared expert; the hub checkpoint is multimodal (models/qwen35.py).
    "qwen3_5_moe": FamilySpec(
        ("qwen3_5_moe_text", "qwen3_5_moe"),
        moe=True,
        shared_expert=True,
        always_renormalize=True,
    ),
    "llama": FamilySpec(("llama",), moe=False),
    "qwen2": FamilySpec(("qwen2",), moe=False),
    "qwen3": FamilySpec(("qwen3",), moe=False),
}

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class AttentionSite:
    """Attention projections that read one input (one GPTQ Hessian, one AWQ scale).

    ``norm`` names the attention module's RMSNorm that produces that input (MLA's low-rank
    norms), where AWQ folds the inverse scale; None: the input is the layer's input norm output
    (q/k/v) or the attention output (o_proj).
    """

    label: str
    projections: tuple[str, ...]
    norm: str | None = None


# GPTQ's true-sequential order through each attention kind: stages of sites.
MHA_SITES = ((AttentionSite("q/k/v", ("q_proj", "k_proj", "v_proj")),),
             (AttentionSite("o_proj", ("o_proj",)),))
# Multi-head latent attention: the down projections read the layer input; q_b and kv_b read the
# low-rank norms' outputs (kv_a's rotary key columns bypass kv_a_layernorm); o reads the heads.
MLA_SITES = ((AttentionSite("q_a/kv_a", ("q_a_proj", "kv_a_proj_with_mqa")),),
             (AttentionSite("q_b", ("q_b_proj",), norm="q_a_layernorm"),
              AttentionSite("kv_b", ("kv_b_proj",), norm="kv_a_layernorm")),
             (AttentionSite("o_proj", ("o_proj",)),))
# Without a query rank (DeepSeek-V2-Lite style configs) the query is one projection.
MLA_FULL_QUERY_SITES = ((AttentionSite("q/kv_a", ("q_proj", "kv_a_proj_with_mqa")),),
                        (AttentionSite("kv_b", ("kv_b_proj",), norm="kv_a_layernorm"),),
                        (AttentionSite("o_proj", ("o_proj",)),))
# Projections whose outputs make attention scores (queries and keys): AWQ leaves them unclipped.
SCORE_PROJECTIONS = frozenset({"q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"})
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_ROLES = ("gate", "up", "down")

# The Llama-style layout every supported family shares, on disk and in transformers' modules.
DISK_LAYERS = "model.layers"
DISK_EMBEDDINGS = "model.embed_tokens"
DISK_FINAL_NORM = "model.norm"
DISK_LM_HEAD = "lm_head"

# transformers 5's fused experts, as keys of one decoder layer's in-memory state dict.
MEMORY_EXPERTS_PREFIX = "mlp.experts."
MEMORY_GATE_UP = MEMORY_EXPERTS_PREFIX + "gate_up_proj"  # [E, 2I, H]
MEMORY_DOWN = MEMORY_EXPERTS_PREFIX + "down_proj"  # [E, H, I]


class Adapter:
    """Uniform access to one model family's modules (Llama-style decoder layout)."""

    # transformers' attention path for layer-by-layer calibration (SDPA: causal without a mask)
    attention_implementation = "sdpa"
    # whether checkpoints keep the experts fused (gpt-oss) rather than one tensor per expert
    fused_experts_on_disk = False
    # whether an expert's down-projection input is linear in its up projection, so that AWQ can
    # divide the up rows by the down scales (not under gpt-oss's clamped (up + 1) gating)
    expert_up_absorbs_scales = True
    # whether rotary turns channel pairs (2i, 2i + 1) of each head rather than (i, i + D/2)
    interleaved_rotary = False
    # RMSNorms multiply by (offset + weight): 1 for zero-centered norms (Qwen3.5), else 0
    norm_weight_offset = 0.0
    # whether q_proj emits each head's query and an output gate (Qwen3.5's full attention)
    gated_attention = False

    def __init__(self, spec: FamilySpec, model_type: str):
        self.spec = spec
        self.model_type = model_type

    # -- model level --------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.spec.moe

    def decoder(self, model: nn.Module) -> nn.Module:
        return model.model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def embeddings(self, model: nn.Module) -> nn.Embedding:
        return model.model.embed_tokens

    def final_norm(self, model: nn.Module) -> nn.Module:
        return model.model.norm

    def rotary_embedding(self, model: nn.Module) -> nn.Module:
        return model.model.rotary_emb

    def set_rotary_embedding(self, model: nn.Module, rotary: nn.Module) -> None:
        model.model.rotary_emb = rotary

    def lm_head(self, model: nn.Module) -> nn.Linear:
        return model.lm_head

    # -- config -------------------------------------------------------------------------------

    def language_config(self, config):
        """The config of the causal LM thresher compresses (a multimodal hub config's text part)."""
        return config

    def num_experts(self, config) -> int:
        if not self.is_moe:
            return 0
        return int(getattr(config, self.spec.num_experts_key))

    def set_num_experts(self, config, n: int) -> None:
        """Write a pruned expert count into ``config``. A grouped router's groups no longer hold
        equal numbers of experts after pruning, so its group limit is dropped (n_group =
        topk_group = 1: plain top-k over the kept experts, which every loader accepts)."""
        setattr(config, self.spec.num_experts_key, int(n))
        if self.spec.router == "sigmoid":
            config.n_group = config.topk_group = 1

    def written_config(self) -> dict[str, int]:
        """config.json entries to set on every checkpoint thresher writes: extra trailing layers
        (multi-token prediction) are not carried, so the config counts none."""
        return {self.spec.extra_layers_key: 0} if self.spec.extra_layers_key else {}

    def layer_num_experts(self, config, layer_idx: int) -> int:
        """Experts of decoder layer ``layer_idx``: a damage-budget pruned checkpoint lists them per
        layer (``layer_num_experts`` in config.json), any other has ``num_experts`` everywhere."""
        per_layer = getattr(config, "layer_num_experts", None)
        return int(per_layer[layer_idx]) if per_layer else self.num_experts(config)

    def resize_experts(self, layer: nn.Module, n: int) -> None:
        """Give an MoE layer's fused experts and router room for ``n`` experts (on the meta device,
        to be loaded with ``assign=True``)."""
        experts, router = self.experts(layer), self.router(layer)
        with torch.device("meta"):
            experts.gate_up_proj = nn.Parameter(torch.empty(n, *experts.gate_up_proj.shape[1:]))
            experts.down_proj = nn.Parameter(torch.empty(n, *experts.down_proj.shape[1:]))
            router.weight = nn.Parameter(torch.empty(n, router.weight.shape[1],
                                                     dtype=router.weight.dtype))
            if getattr(router, "bias", None) is not None:
                router.bias = nn.Parameter(torch.empty(n, dtype=router.bias.dtype))
            name = self.spec.router_correction
            if name and getattr(router, name, None) is not None:
                setattr(router, name, torch.empty(n, dtype=getattr(router, name).dtype))
        for module in (experts, router):
            if hasattr(module, "num_experts"):
                module.num_experts = n

    def router_expert_dim(self, key: str) -> int:
        """The expert axis of the router tensor ``key`` (layer-relative, in memory): 0, except
        for a correction bias kept as a [1, E] row (ERNIE-4.5)."""
        return 0

    def leading_dense_layers(self, config) -> int:
        """How many decoder layers before the first MoE one have a dense MLP (GLM-4.5: 1)."""
        key = self.spec.dense_layers_key
        return int(getattr(config, key, 0) or 0) if key and self.is_moe else 0

    def moe_layer_step(self, config) -> int:
        """Every how many layers, after the dense leading ones, an MoE layer comes (1: all)."""
        return 1

    def top_k(self, config) -> int:
        return int(config.num_experts_per_tok) if self.is_moe else 0

    def norm_topk_prob(self, config) -> bool:
        """Whether the config asks for top-k renormalization (REAP's gate follows this flag)."""
        return bool(getattr(config, "norm_topk_prob", False))

    def forward_renormalizes(self, config) -> bool:
        """Whether the model's forward pass renormalizes the top-k gate values."""
        return self.spec.always_renormalize or self.norm_topk_prob(config)

    # -- decoder layer ------------------------------------------------------------------------

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    @property
    def attention_kind(self) -> str:
        """``mha`` (q/k/v/o, grouped-query included) or ``mla`` (multi-head latent attention)."""
        return self.spec.attention

    def attention_sites(self, layer: nn.Module) -> tuple[tuple[AttentionSite, ...], ...]:
        """The attention projections in GPTQ's sequential stages, grouped by shared input."""
        if self.spec.attention == "mha":
            return MHA_SITES
        return MLA_SITES if layer.self_attn.q_proj is None else MLA_FULL_QUERY_SITES

    def attention_projections(self, layer: nn.Module) -> dict[str, nn.Linear]:
        attn = self.attention(layer)
        return {name: getattr(attn, name) for stage in self.attention_sites(layer)
                for site in stage for name in site.projections}

    def linear_attention_layers(self, config) -> list[int]:
        """Indices of the layers whose token mixer is a linear-attention recurrence (none)."""
        return []

    def attention_takes_positions(self, layer: nn.Module) -> bool:
        """Whether ``layer``'s token mixer is called with rotary position embeddings (not a
        Gated DeltaNet)."""
        return True

    def attention_float_inputs(self, layer: nn.Module) -> list[nn.Linear]:
        """16-bit linears that read the attention's input beside the quantized ones (none here)."""
        return []

    def input_norm(self, layer: nn.Module) -> nn.Module:
        return layer.input_layernorm

    def post_attention_norm(self, layer: nn.Module) -> nn.Module:
        return layer.post_attention_layernorm

    def mlp(self, layer: nn.Module) -> nn.Module:
        return layer.mlp

    def sliding_window(self, config, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (None: full causal attention)."""
        return None

    def layer_attention_mask(self, config, layer_idx: int, hidden: torch.Tensor
                             ) -> torch.Tensor | None:
        """The mask a decoder layer's attention takes for ``hidden`` [B, S, H] (None: causal)."""
        return None

    def is_moe_layer(self, layer: nn.Module) -> bool:
        return self.is_moe and hasattr(layer.mlp, "experts")

    def dense_mlp_projections(self, layer: nn.Module) -> dict[str, nn.Linear]:
        """gate/up/down of a dense MLP layer (dense families, or dense layers of an MoE)."""
        return {name: getattr(layer.mlp, name) for name in MLP_PROJECTIONS}

    def router(self, layer: nn.Module) -> nn.Module:
        """The router module; ``.weight`` is [E, H]."""
        return layer.mlp.gate

    def experts(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.experts

    def expert_view(self, layer: nn.Module, e: int) -> ExpertWeights:
        experts = self.experts(layer)
        inter = experts.down_proj.shape[-1]
        gate_up = experts.gate_up_proj.data[e]
        return ExpertWeights(
            gate=gate_up[:inter], up=gate_up[inter:], down=experts.down_proj.data[e]
        )

    def shared_expert(self, layer: nn.Module) -> nn.Module | None:
        """The always-on expert added to the routed output (never pruned; quantized like a dense
        MLP), or None."""
        if not self.spec.shared_expert:
            return None
        return getattr(layer.mlp, self.spec.shared_expert_name, None)

    def shared_expert_gate(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer.mlp, "shared_expert_gate", None) if self.spec.shared_expert else None

    def routing_rule(self, layer: nn.Module, config) -> RoutingRule:
        """How ``layer``'s router decides (see ``RoutingRule``)."""
        name = self.spec.router_correction
        bias = getattr(self.router(layer), name) if name else None
        return self.rule(config, bias)

    def rule(self, config, correction: torch.Tensor | None = None) -> RoutingRule:
        """The routing rule of ``config``'s MoE layers, with one layer's score-correction bias."""
        if correction is not None:
            correction = correction.detach().float().reshape(-1).clone()
        if self.spec.router == "softmax":
            return RoutingRule(self.top_k(config), self.forward_renormalizes(config),
                               bias=correction)
        return RoutingRule(
            self.top_k(config), self.norm_topk_prob(config), scoring="sigmoid",
            bias=correction,
            n_group=int(getattr(config, "n_group", 1) or 1),
            topk_group=int(getattr(config, "topk_group", 1) or 1),
            scaling=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))

    def route(self, layer: nn.Module, hidden: torch.Tensor, config) -> Routing:
        """Routing of ``hidden`` [T, H] (the MoE block's input) exactly as the forward does it."""
        router = self.router(layer)
        if self.spec.fp32_router:
            logits = torch.nn.functional.linear(hidden.float(), router.weight.float())
        else:
            logits = torch.nn.functional.linear(hidden, router.weight)
        rule = self.routing_rule(layer, config)
        top_w, top_i = rule.select(logits)
        return Routing(logits=logits, probs=rule.scores(logits), top_k_index=top_i,
                       top_k_weights=top_w)

    def saliency_gates(self, routing: Routing, config) -> torch.Tensor:
        """REAP's g_j(x) for each selected expert [T, k]. Softmax routers: the softmax value,
        renormalized over the top-k when the config asks (as the REAP reference code does).
        Sigmoid routers: the gate values the forward multiplies by (unbiased scores,
        normalized, times the routed scaling factor)."""
        if self.spec.router == "sigmoid":
            return routing.top_k_weights.float()
        g = routing.probs.gather(-1, routing.top_k_index)
        if self.norm_topk_prob(config):
            g = g / g.sum(dim=-1, keepdim=True)
        return g

    def expert_forward(self, layer: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's output f_e(x) before gating, for tokens x [T, H]."""
        return torch.nn.functional.linear(self.expert_hidden(layer, e, x),
                                          self.expert_view(layer, e).down)

    def expert_down_bias(self, layer: nn.Module, e: int) -> torch.Tensor | None:
        """Expert ``e``'s down-projection bias [H] (gpt-oss), or None."""
        return None

    def glu(self, experts: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(gate x, up x) -> the input of an expert's down projection, for ``experts``' family."""
        act = experts.act_fn
        return lambda gate, up: act(gate) * up

    def down_to_fused(self, down: torch.Tensor) -> torch.Tensor:
        """One expert's down projection [H, I] as the fused ``down_proj`` holds it."""
        return down

    def expert_hidden(self, layer: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        """act(gate x) * up x: the input of expert ``e``'s down projection, for tokens x [T, H]."""
        w = self.expert_view(layer, e)
        act = self.experts(layer).act_fn
        return act(torch.nn.functional.linear(x, w.gate)) * torch.nn.functional.linear(x, w.up)

    # -- on-disk names ------------------------------------------------------------------------
    # Module names without ``.weight``, as hub checkpoints and vLLM spell them.

    def disk_layer_prefix(self, layer_idx: int) -> str:
        """The prefix (trailing dot included) of every tensor of decoder layer ``layer_idx``."""
        return f"{DISK_LAYERS}.{layer_idx}."

    def is_disk_layer_key(self, key: str) -> bool:
        """Whether ``key`` belongs to a decoder layer (rather than embeddings, norm, head)."""
        return key.startswith(DISK_LAYERS + ".")

    def disk_attention_key(self, layer_idx: int, name: str) -> str:
        """``name`` in ``q_proj|k_proj|v_proj|o_proj|q_norm|k_norm`` (MLA: ``q_a_proj|q_b_proj|
        kv_a_proj_with_mqa|kv_b_proj|q_a_layernorm|kv_a_layernorm``) of layer ``layer_idx``."""
        return f"{self.disk_layer_prefix(layer_idx)}self_attn.{name}"

    def disk_input_norm_key(self, layer_idx: int) -> str:
        return f"{self.disk_layer_prefix(layer_idx)}input_layernorm"

    def disk_post_attention_norm_key(self, layer_idx: int) -> str:
        return f"{self.disk_layer_prefix(layer_idx)}post_attention_layernorm"

    def disk_dense_mlp_key(self, layer_idx: int, proj: str) -> str:
        """``proj`` in ``gate_proj|up_proj|down_proj`` of a dense MLP layer."""
        return f"{self.disk_layer_prefix(layer_idx)}mlp.{proj}"

    def disk_expert_key(self, layer_idx: int, e: int, proj: str) -> str:
        """Hub-canonical name (without ``.weight``) of expert ``e``'s ``proj`` in ``gate|up|down``."""
        name = dict(zip(EXPERT_ROLES, self.spec.disk_expert_names, strict=True))[proj]
        return f"{self._disk_moe(layer_idx)}.experts.{e}.{name}"

    def parse_disk_expert_key(self, key: str) -> tuple[int, int, str] | None:
        """(layer, expert, ``gate|up|down``) of a per-expert module name (without ``.weight``);
        None for any other name."""
        m = re.fullmatch(rf"{re.escape(DISK_LAYERS)}\.(\d+)\.{re.escape(self.spec.disk_moe_prefix)}"
                         r"\.experts\.(\d+)\.(\w+)", key)
        roles = dict(zip(self.spec.disk_expert_names, EXPERT_ROLES, strict=True))
        if m is None or m.group(3) not in roles:
            return None
        return int(m.group(1)), int(m.group(2)), roles[m.group(3)]

    def disk_router_key(self, layer_idx: int) -> str:
        return f"{self._disk_moe(layer_idx)}.gate"

    def disk_shared_expert_key(self, layer_idx: int, proj: str) -> str:
        """``proj`` in ``gate_proj|up_proj|down_proj`` of the shared expert (Qwen2-MoE, GLM)."""
        return f"{self._disk_moe(layer_idx)}.{self.spec.shared_expert_name}.{proj}"

    def disk_router_correction_key(self, layer_idx: int) -> str | None:
        """The tensor name of the router's score-correction bias, for families that have one."""
        name = self.spec.router_correction
        return f"{self.disk_router_key(layer_idx)}.{name}" if name else None

    def disk_shared_expert_gate_key(self, layer_idx: int) -> str:
        return f"{self._disk_moe(layer_idx)}.shared_expert_gate"

    def per_expert_reader(self, reader):
        """``reader`` (a CheckpointReader) with experts under per-expert names: itself, except
        where the family keeps them fused on disk (gpt-oss)."""
        return reader

    def hub_experts(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors with experts under per-expert names (weights and biases, all of a
        layer's) in the family's hub layout: themselves, except where the hub fuses them."""
        return tensors

    def disk_embeddings_key(self) -> str:
        return DISK_EMBEDDINGS

    def disk_final_norm_key(self) -> str:
        return DISK_FINAL_NORM

    def disk_lm_head_key(self) -> str:
        return DISK_LM_HEAD

    def _disk_moe(self, layer_idx: int) -> str:
        return f"{self.disk_layer_prefix(layer_idx)}{self.spec.disk_moe_prefix}"

    def memory_key_from_disk(self, key: str) -> str:
        """Map a non-expert on-disk key to the in-memory parameter name."""
        prefix = self.spec.disk_moe_prefix
        if prefix != "mlp":
            key = key.replace(f".{prefix}.", ".mlp.")
        return key

    def disk_key_from_memory(self, key: str) -> str:
        """Map a non-expert in-memory parameter name to its on-disk key."""
        prefix = self.spec.disk_moe_prefix
        if prefix != "mlp":
            key = key.replace(".mlp.", f".{prefix}.")
        return key


def supported_model_types() -> list[str]:
    return sorted(t for spec in FAMILIES.values() for t in spec.model_types)


def get_adapter(config_or_type) -> Adapter:
    """The adapter for a transformers config (or a ``model_type`` string)."""
    model_type = config_or_type if isinstance(config_or_type, str) else config_or_type.model_type
    for family, spec in FAMILIES.items():
        if model_type in spec.model_types:
            return _adapter_class(family)(spec, model_type)
    raise UnsupportedArchitectureError(
        f"model type {model_type!r} has no thresher adapter; supported: "
        + ", ".join(supported_model_types())
    )


def _adapter_class(family: str) -> type[Adapter]:
    """The Adapter subclass of a family whose modules are not Llama-shaped (imported on use:
    those modules build on this one)."""
    if family == "gpt_oss":
        from thresher.models.gpt_oss import GptOssAdapter

        return GptOssAdapter
    if family == "ernie4_5_moe":
        from thresher.models.ernie import ErnieAdapter

        return ErnieAdapter
    if family == "qwen3_5_moe":
        from thresher.models.qwen35 import Qwen35Adapter

        return Qwen35Adapter
    return Adapter
