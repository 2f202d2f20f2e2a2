"""The ERNIE-4.5-MoE family's adapter: where its modules differ from the Llama-shaped families.

ERNIE-4.5 routes with a softmax over the experts in fp32, *selects* the top-k on the softmax plus a
score-correction bias and gates with the softmax values of the selected experts, renormalized
(always). The bias sits in ``mlp.gate.moe_statics.e_score_correction_bias`` [1, E] in memory and
in ``mlp.moe_statics.e_score_correction_bias`` on the hub, so its expert axis is the last one.
Which layers are MoE follows ``moe_layer_start_index`` / ``moe_layer_interval`` /
``moe_layer_end_index`` (the 21B and 300B models: every layer from the second on); the others,
and the always-on ``shared_experts``, are dense SwiGLU MLPs. Rotary turns interleaved channel
pairs (2i, 2i + 1) of each head, over the full head.
"""

from __future__ import annotations

import torch
from torch import nn

from thresher.models.adapters import Adapter, RoutingRule

MEMORY_STATICS = ".mlp.gate.moe_statics."
DISK_STATICS = ".mlp.moe_statics."
MTP_PREFIX = "model.mtp"


class ErnieAdapter(Adapter):
    """ERNIE-4.5-MoE (``ernie4_5_moe``): see the module docstring."""

    interleaved_rotary = True

    def norm_topk_prob(self, config) -> bool:
        """The forward renormalizes the selected gate values whatever the config says."""
        return True

    def leading_dense_layers(self, config) -> int:
        """The dense layers before the first MoE one (the first MoE layer is the first index
        from ``moe_layer_start_index`` on that ends an interval)."""
        interval = int(config.moe_layer_interval)
        start = int(config.moe_layer_start_index)
        return next((i for i in range(config.num_hidden_layers)
                     if (i + 1) % interval == 0 and i >= start), config.num_hidden_layers)

    def moe_layer_step(self, config) -> int:
        return int(config.moe_layer_interval)

    def correction(self, layer: nn.Module) -> torch.Tensor:
        return self.router(layer).moe_statics.e_score_correction_bias

    def routing_rule(self, layer: nn.Module, config) -> RoutingRule:
        return self.rule(config, self.correction(layer))

    def router_expert_dim(self, key: str) -> int:
        return -1 if ".moe_statics." in "." + key else 0

    def resize_experts(self, layer: nn.Module, n: int) -> None:
        super().resize_experts(layer, n)
        statics = self.router(layer).moe_statics
        with torch.device("meta"):
            statics.e_score_correction_bias = nn.Parameter(
                torch.empty(1, n, dtype=statics.e_score_correction_bias.dtype),
                requires_grad=False)

    def is_disk_layer_key(self, key: str) -> bool:
        """Decoder-layer tensors, and the multi-token-prediction block (``model.mtp_*``, which
        transformers does not load): neither is copied as a model-level tensor, so MTP is not
        carried into artifacts."""
        return super().is_disk_layer_key(key) or key.startswith(MTP_PREFIX)

    def disk_router_correction_key(self, layer_idx: int) -> str:
        return f"{self._disk_moe(layer_idx)}.moe_statics.e_score_correction_bias"

    def memory_key_from_disk(self, key: str) -> str:
        return key.replace(DISK_STATICS, MEMORY_STATICS)

    def disk_key_from_memory(self, key: str) -> str:
        return key.replace(MEMORY_STATICS, DISK_STATICS)
