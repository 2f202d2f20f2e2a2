"""The Qwen3.5-MoE family's adapter: a hybrid of Gated DeltaNet and gated full attention.

Qwen3.5-MoE (``qwen3_5_moe``, language model only) alternates two token mixers, as
``config.layer_types`` lists them: ``linear_attention`` layers hold a Gated DeltaNet
(``linear_attn``: ``in_proj_qkv`` through a depthwise causal ``conv1d``, ``in_proj_z`` for the
output gate, ``in_proj_b`` / ``in_proj_a`` for the per-head write strength and decay,
``A_log``, ``dt_bias``, a gated RMSNorm ``norm`` and ``out_proj``); ``full_attention`` layers hold
a GQA attention whose ``q_proj`` emits the query and a sigmoid output gate per head (interleaved
head by head), with q/k norms and partial rotary. Every layer's MLP is MoE: a softmax top-k
router renormalized always, and a shared expert scaled by ``sigmoid(shared_expert_gate x)``.

Its RMSNorms (the layers', the final one, q/k norms) multiply by ``1 + weight`` (zero-centered),
so folding a scale into one divides ``1 + weight``; the DeltaNet's gated norm is a plain one.

Quantization: the attention projections, ``in_proj_qkv``, ``in_proj_z`` and ``out_proj`` are
quantized; ``in_proj_a`` / ``in_proj_b`` (one output per value head) and ``conv1d`` stay in 16
bits, as Qwen's and GPTQModel's GPTQ checkpoints of the family store them and as vLLM's loader
expects (docs/quantization.md).

The hub checkpoint is the multimodal model: the language model's tensors sit under
``model.language_model.`` and its config under ``text_config``; the vision tower
(``model.visual.``) and the multi-token-prediction block (``mtp.``) are not carried, and
thresher's artifacts are the text model (``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``) under
the usual ``model.layers.`` names (models/checkpoint.py reads either layout).
"""

from __future__ import annotations

from torch import nn

from thresher.models.adapters import MHA_SITES, Adapter, AttentionSite

LINEAR_ATTENTION = "linear_attention"
MULTIMODAL_TYPE = "qwen3_5_moe"
# GPTQ's stages through a Gated DeltaNet: the input projections read the input norm's output;
# out_proj reads the gated norm's output. in_proj_a / in_proj_b stay in 16 bits (module docstring).
DELTANET_SITES = ((AttentionSite("in_proj qkv/z", ("in_proj_qkv", "in_proj_z")),),
                  (AttentionSite("out_proj", ("out_proj",)),))
DELTANET_FLOAT = ("in_proj_a", "in_proj_b")


class Qwen35Adapter(Adapter):
    """Qwen3.5-MoE (``qwen3_5_moe`` / ``qwen3_5_moe_text``): see the module docstring."""

    norm_weight_offset = 1.0
    gated_attention = True

    def language_config(self, config):
        """The text model's config: the hub's multimodal config carries it as ``text_config``."""
        if config.model_type == MULTIMODAL_TYPE:
            return config.get_text_config()
        return config

    def norm_topk_prob(self, config) -> bool:
        """The router renormalizes the selected gate values whatever the config says."""
        return True

    def is_linear_attention(self, layer: nn.Module) -> bool:
        return hasattr(layer, "linear_attn")

    def linear_attention_layers(self, config) -> list[int]:
        """Indices of the Gated DeltaNet layers."""
        return [i for i, t in enumerate(config.layer_types) if t == LINEAR_ATTENTION]

    def full_attention_interval(self, config) -> int | None:
        """Every how many layers a full-attention one comes (the last of each period), as
        llama.cpp's hybrid graphs lay layers out; None if ``layer_types`` is not so periodic."""
        types = list(config.layer_types)
        if "full_attention" not in types:
            return None
        n = types.index("full_attention") + 1
        periodic = all((t == "full_attention") == ((i + 1) % n == 0) for i, t in enumerate(types))
        return n if periodic else None

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.linear_attn if self.is_linear_attention(layer) else layer.self_attn

    def attention_sites(self, layer: nn.Module):
        return DELTANET_SITES if self.is_linear_attention(layer) else MHA_SITES

    def attention_takes_positions(self, layer: nn.Module) -> bool:
        return not self.is_linear_attention(layer)

    def attention_float_inputs(self, layer: nn.Module) -> list[nn.Linear]:
        """16-bit linears reading the same input as the first attention site (AWQ multiplies
        them by its scale so the float model is unchanged)."""
        if not self.is_linear_attention(layer):
            return []
        return [getattr(layer.linear_attn, name) for name in DELTANET_FLOAT]
