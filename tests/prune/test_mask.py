"""Choosing experts and cutting them out of a layer's state."""

import pytest
import torch

from thresher.errors import CompressionError
from thresher.models import get_adapter
from thresher.prune.mask import choose_experts, experts_to_keep, prune_layer_state, router_prefix


def test_experts_to_keep_ratio_and_keep():
    assert experts_to_keep(8, 2, 0.5, None, "m") == 4
    assert experts_to_keep(8, 2, 0.25, None, "m") == 6
    assert experts_to_keep(8, 2, 0.3, None, "m") == 6  # floor(8 * 0.3) = 2 removed
    assert experts_to_keep(8, 2, None, 5, "m") == 5


@pytest.mark.parametrize(("ratio", "keep", "message"), [
    (0.0, None, "in \\(0, 1\\)"),
    (1.0, None, "in \\(0, 1\\)"),
    (-0.5, None, "in \\(0, 1\\)"),
    (0.1, None, "removes none"),
    (0.9, None, "fewer than the 2 each token is routed to"),
    (None, 1, "fewer than the 2"),
    (None, 8, "between 1 and 7"),
    (None, None, "exactly one of ratio and keep"),
    (0.5, 4, "exactly one of ratio and keep"),
])
def test_experts_to_keep_refuses(ratio, keep, message):
    with pytest.raises(CompressionError, match=message):
        experts_to_keep(8, 2, ratio, keep, "my-model")


def test_choose_experts_keeps_highest_and_breaks_ties_by_index():
    s = torch.tensor([0.5, 3.0, 0.0, 2.0, 2.0, 0.5], dtype=torch.float64)
    assert choose_experts(s, 3) == [1, 3, 4]
    assert choose_experts(s, 4) == [0, 1, 3, 4]  # 0.5 tie: the lower index stays


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_prune_layer_state_slices_router_bias_and_correction_bias(family):
    adapter = get_adapter(family)
    router = router_prefix(adapter, 3)
    assert router == "mlp.gate."
    e, h, i = 6, 4, 2
    state = {
        router + "weight": torch.arange(e * h, dtype=torch.float32).view(e, h),
        router + "bias": torch.arange(e, dtype=torch.float32),
        router + "e_score_correction_bias": torch.arange(e, dtype=torch.float32) * 10,
        "mlp.experts.gate_up_proj": torch.arange(e, dtype=torch.float32).view(e, 1, 1).expand(
            e, 2 * i, h).clone(),
        "mlp.experts.down_proj": torch.arange(e, dtype=torch.float32).view(e, 1, 1).expand(
            e, h, i).clone(),
        "mlp.shared_expert.up_proj.weight": torch.ones(8, h),
        "self_attn.q_proj.weight": torch.ones(h, h),
    }
    out = prune_layer_state(adapter, 3, state, [1, 4, 5], e)
    assert out[router + "weight"][:, 0].tolist() == [4.0, 16.0, 20.0]
    assert out[router + "bias"].tolist() == [1.0, 4.0, 5.0]
    assert out[router + "e_score_correction_bias"].tolist() == [10.0, 40.0, 50.0]
    assert out["mlp.experts.gate_up_proj"][:, 0, 0].tolist() == [1.0, 4.0, 5.0]
    assert out["mlp.experts.down_proj"].shape == (3, h, i)
    assert out["mlp.shared_expert.up_proj.weight"] is state["mlp.shared_expert.up_proj.weight"]
    assert out["self_attn.q_proj.weight"] is state["self_attn.q_proj.weight"]


def test_prune_layer_state_refuses_a_dense_layer_and_odd_shapes():
    adapter = get_adapter("qwen3_moe")
    with pytest.raises(CompressionError, match="no router"):
        prune_layer_state(adapter, 0, {"mlp.up_proj.weight": torch.ones(4, 4)}, [0], 4)
    bad = {"mlp.gate.weight": torch.ones(5, 4), "mlp.experts.down_proj": torch.ones(4, 4, 2)}
    with pytest.raises(CompressionError, match="expected 4 experts"):
        prune_layer_state(adapter, 0, bad, [0, 1], 4)
