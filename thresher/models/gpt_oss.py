"""The gpt-oss family's adapter: where its modules differ from the Llama-shaped families.

gpt-oss keeps its experts fused on the hub as well as in memory (``mlp.experts.gate_up_proj``
[E, H, 2I] with gate and up in alternating columns, ``down_proj`` [E, I, H], a bias for each),
routes with a biased ``mlp.router`` (top-k of the logits, then a softmax over the k), gates with
a clamped SwiGLU (``(up + 1) * gate * sigmoid(alpha * gate)``, gate clamped above and up on both
sides at ``limit``), and attends with a learned per-head sink logit in the softmax denominator,
every other layer over a sliding window. Its sinks need the eager attention path of transformers
(SDPA has no place for them), which takes an explicit mask, so the adapter builds each layer's
causal or sliding-window mask.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from thresher.errors import ModelError
from thresher.models import mxfp4
from thresher.models.adapters import (
    EXPERT_ROLES,
    MEMORY_DOWN,
    MEMORY_EXPERTS_PREFIX,
    Adapter,
    ExpertWeights,
    Routing,
    RoutingRule,
)

SLIDING = "sliding_attention"
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"
FUSED = (FUSED_GATE_UP, FUSED_GATE_UP + "_bias", FUSED_DOWN, FUSED_DOWN + "_bias")


class GptOssAdapter(Adapter):
    """gpt-oss (``gpt_oss``): see the module docstring."""

    attention_implementation = "eager"
    fused_experts_on_disk = True
    expert_up_absorbs_scales = False

    # -- routing ------------------------------------------------------------------------------

    def router(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.router

    def rule(self, config, correction: torch.Tensor | None = None) -> RoutingRule:
        return RoutingRule(self.top_k(config), renormalize=False, scoring="topk_softmax")

    def route(self, layer: nn.Module, hidden: torch.Tensor, config) -> Routing:
        router = self.router(layer)
        logits = torch.nn.functional.linear(hidden, router.weight, router.bias)
        top_w, top_i = self.rule(config).select(logits)
        return Routing(logits=logits, probs=torch.softmax(logits.float(), dim=-1),
                       top_k_index=top_i, top_k_weights=top_w)

    def saliency_gates(self, routing: Routing, config) -> torch.Tensor:
        """The gate values the forward multiplies by: softmax over the selected logits."""
        return routing.top_k_weights.float()

    def norm_topk_prob(self, config) -> bool:
        return False

    def forward_renormalizes(self, config) -> bool:
        return False

    # -- experts ------------------------------------------------------------------------------

    def expert_view(self, layer: nn.Module, e: int) -> ExpertWeights:
        experts = self.experts(layer)
        gate_up = experts.gate_up_proj.data[e]  # [H, 2I], gate in even columns, up in odd
        return ExpertWeights(gate=gate_up[:, 0::2].t(), up=gate_up[:, 1::2].t(),
                             down=experts.down_proj.data[e].t())

    def expert_biases(self, layer: nn.Module, e: int) -> ExpertWeights:
        """Expert ``e``'s biases (gate [I], up [I], down [H]), views like ``expert_view``."""
        experts = self.experts(layer)
        gate_up = experts.gate_up_proj_bias.data[e]
        return ExpertWeights(gate=gate_up[0::2], up=gate_up[1::2],
                             down=experts.down_proj_bias.data[e])

    def expert_down_bias(self, layer: nn.Module, e: int) -> torch.Tensor | None:
        return self.experts(layer).down_proj_bias.data[e]

    def down_to_fused(self, down: torch.Tensor) -> torch.Tensor:
        return down.t()

    def glu(self, experts: nn.Module):
        return partial(clamped_swiglu, alpha=experts.alpha, limit=experts.limit)

    def expert_hidden(self, layer: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of expert ``e``: the input of its down projection."""
        w, b = self.expert_view(layer, e), self.expert_biases(layer, e)
        experts = self.experts(layer)
        gate = torch.nn.functional.linear(x, w.gate, b.gate)
        up = torch.nn.functional.linear(x, w.up, b.up)
        return clamped_swiglu(gate, up, experts.alpha, experts.limit)

    def expert_forward(self, layer: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.expert_hidden(layer, e, x),
                                          self.expert_view(layer, e).down,
                                          self.expert_biases(layer, e).down)

    def resize_experts(self, layer: nn.Module, n: int) -> None:
        experts, router = self.experts(layer), self.router(layer)
        with torch.device("meta"):
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                old = getattr(experts, name)
                setattr(experts, name, nn.Parameter(torch.empty(n, *old.shape[1:],
                                                                dtype=old.dtype)))
            router.weight = nn.Parameter(torch.empty(n, router.weight.shape[1],
                                                     dtype=router.weight.dtype))
            router.bias = nn.Parameter(torch.empty(n, dtype=router.bias.dtype))
        experts.num_experts = router.num_experts = n

    # -- attention ----------------------------------------------------------------------------

    def sliding_window(self, config, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (None: full causal attention)."""
        return int(config.sliding_window) if config.layer_types[layer_idx] == SLIDING else None

    def layer_attention_mask(self, config, layer_idx: int, hidden: torch.Tensor
                             ) -> torch.Tensor | None:
        """The additive [1, 1, S, S] mask of layer ``layer_idx`` for ``hidden`` [B, S, H]."""
        return causal_mask(hidden.shape[1], self.sliding_window(config, layer_idx),
                           hidden.dtype, hidden.device)

    # -- on-disk names ------------------------------------------------------------------------

    def disk_router_key(self, layer_idx: int) -> str:
        return f"{self._disk_moe(layer_idx)}.router"

    def per_expert_reader(self, reader):
        return PerExpertReader(reader, self)

    def per_expert_state(self, layer_idx: int, fused: dict[str, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
        """The fused experts (relative keys) as per-expert modules with their biases:
        ``mlp.experts.E.{gate,up,down}_proj.{weight,bias}`` in nn.Linear layout, the names of
        vLLM's per-expert mapping for gpt-oss (quantized checkpoints; docs/architecture.md)."""
        gate_up, down = fused[MEMORY_EXPERTS_PREFIX + "gate_up_proj"], fused[MEMORY_DOWN]
        gate_up_bias = fused[MEMORY_EXPERTS_PREFIX + "gate_up_proj_bias"]
        down_bias = fused[MEMORY_EXPERTS_PREFIX + "down_proj_bias"]
        out: dict[str, torch.Tensor] = {}
        for e in range(gate_up.shape[0]):
            parts = {"gate": (gate_up[e][:, 0::2].t(), gate_up_bias[e][0::2]),
                     "up": (gate_up[e][:, 1::2].t(), gate_up_bias[e][1::2]),
                     "down": (down[e].t(), down_bias[e])}
            for role, (weight, bias) in parts.items():
                key = self.disk_expert_key(layer_idx, e, role)
                out[f"{key}.weight"], out[f"{key}.bias"] = weight.contiguous(), bias.contiguous()
        return out

    def hub_experts(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of ``per_expert_state``: each layer's per-expert weights and biases fused
        into the hub tensors, gate and up interleaved in columns; other tensors pass as they are."""
        out: dict[str, torch.Tensor] = {}
        layers: dict[int, dict[tuple[int, str, str], torch.Tensor]] = {}
        for key, t in tensors.items():
            module, _, kind = key.rpartition(".")
            expert = self.parse_disk_expert_key(module)
            if expert is None:
                out[key] = t
            else:
                layer_idx, e, role = expert
                layers.setdefault(layer_idx, {})[(e, role, kind)] = t
        for layer_idx, parts in layers.items():
            out.update(self._fused_experts(layer_idx, parts))
        return out

    def _fused_experts(self, layer_idx: int, parts: dict[tuple[int, str, str], torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
        """Layer ``layer_idx``'s hub tensors from its experts' (expert, role, weight|bias)."""
        n = 1 + max(e for e, _, _ in parts)
        missing = [(e, r, k) for e in range(n) for r in EXPERT_ROLES for k in ("weight", "bias")
                   if (e, r, k) not in parts]
        if missing:
            raise ModelError(f"layer {layer_idx} lacks expert tensors {missing[:4]}; the hub's "
                             "fused experts need every expert's weights and biases")
        prefix = self.disk_layer_prefix(layer_idx)
        gate_up, gate_up_bias, down, down_bias = [], [], [], []
        for e in range(n):
            gate, up = parts[(e, "gate", "weight")], parts[(e, "up", "weight")]  # [I, H]
            gate_up.append(torch.stack([gate, up], dim=1).flatten(0, 1).t())  # cols g0, u0, g1..
            gate_up_bias.append(torch.stack([parts[(e, "gate", "bias")],
                                             parts[(e, "up", "bias")]], dim=1).flatten())
            down.append(self.down_to_fused(parts[(e, "down", "weight")]))
            down_bias.append(parts[(e, "down", "bias")])
        fused = (torch.stack(gate_up), torch.stack(gate_up_bias), torch.stack(down),
                 torch.stack(down_bias))
        return {prefix + name: t.contiguous() for name, t in zip(FUSED, fused, strict=True)}


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
                   ) -> torch.Tensor:
    """gpt-oss's activation: gate clamped above, up on both sides, at ``limit``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def causal_mask(length: int, window: int | None, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive causal mask [1, 1, S, S]; with ``window``, each query sees its last ``window``
    positions (itself included), as transformers' sliding-window mask does."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class PerExpertReader:
    """A gpt-oss checkpoint's fused experts seen one expert at a time, under the per-expert names
    of ``GptOssAdapter.per_expert_state`` (weights [out, in], biases beside them), for readers
    that stack experts themselves (GGUF export). MXFP4 experts are dequantized (fp32). Other
    tensors pass through; the fused tensor last read is kept, so walking its experts reads it
    once."""

    def __init__(self, reader, adapter: GptOssAdapter):
        self.reader, self.path = reader, reader.path
        self._views: dict[str, tuple[str, int, str]] = {}  # key -> (fused key, expert, part)
        self._fused: set[str] = set()
        self._last: tuple[str, torch.Tensor] | None = None
        for name in reader.tensor_names():
            name = name.removesuffix(mxfp4.BLOCKS_SUFFIX)
            if not name.endswith(FUSED_GATE_UP):
                continue
            layer_prefix = name.removesuffix(FUSED_GATE_UP)
            layer_idx = int(layer_prefix.rstrip(".").rsplit(".", 1)[1])
            self._fused |= {layer_prefix + k + suffix for k in FUSED
                            for suffix in ("", mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX)}
            for e in range(self._fused_shape(name)[0]):
                for role, fused in (("gate", FUSED_GATE_UP), ("up", FUSED_GATE_UP),
                                    ("down", FUSED_DOWN)):
                    key = adapter.disk_expert_key(layer_idx, e, role)
                    self._views[f"{key}.weight"] = (layer_prefix + fused, e, role)
                    self._views[f"{key}.bias"] = (layer_prefix + fused + "_bias", e, role)

    def tensor_names(self) -> list[str]:
        return [k for k in self.reader.tensor_names() if k not in self._fused] + list(self._views)

    def __contains__(self, key: str) -> bool:
        return key in self._views or (key in self.reader and key not in self._fused)

    def _fused_shape(self, fused: str) -> tuple[int, ...]:
        if fused in self.reader:
            return self.reader.shape(fused)
        blocks = self.reader.shape(fused + mxfp4.BLOCKS_SUFFIX)  # [E, rows, cols / 32, 16]
        return (blocks[0], blocks[2] * mxfp4.BLOCK, blocks[1])

    def _fused_get(self, fused: str) -> torch.Tensor:
        if fused in self.reader:
            return self.reader.get(fused)
        return mxfp4.dequantize(self.reader.get(fused + mxfp4.BLOCKS_SUFFIX),
                                self.reader.get(fused + mxfp4.SCALES_SUFFIX), torch.float32,
                                f"{self.path}: {fused}")

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._views:
            return self.reader.shape(key)
        fused, _, role = self._views[key]
        shape = self._fused_shape(fused)  # [E, H, 2I], [E, 2I], [E, I, H] or [E, H]
        if len(shape) == 2:
            return (shape[1] // 2,) if role != "down" else (shape[1],)
        return (shape[2] // 2, shape[1]) if role != "down" else (shape[2], shape[1])

    def get(self, key: str) -> torch.Tensor:
        if key not in self._views:
            return self.reader.get(key)
        fused, e, role = self._views[key]
        if self._last is None or self._last[0] != fused:
            self._last = (fused, self._fused_get(fused))
        t = self._last[1][e]
        if role == "down":
            return t.t() if t.dim() == 2 else t
        cols = slice(0, None, 2) if role == "gate" else slice(1, None, 2)
        return t[:, cols].t() if t.dim() == 2 else t[cols]

    def close(self) -> None:
        self._last = None
        self.reader.close()
