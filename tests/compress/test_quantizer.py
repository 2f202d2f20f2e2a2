"""The grid fit on the trained tiny demo's weights: the MSE scale search never loses to min-max."""

import pytest
import torch

from thresher.compress.quantizer import GridSpec, dequantize, fit_grid, quantize
from thresher.models import load_model


@pytest.fixture(scope="module")
def tiny_weights(tiny_demo):
    model = load_model(tiny_demo)
    layer = model.model.layers[1]
    return {"q_proj": layer.self_attn.q_proj.weight.detach(),
            "expert gate_up": layer.mlp.experts.gate_up_proj[3].detach(),
            "expert down": layer.mlp.experts.down_proj[3].detach()}


def group_errors(w: torch.Tensor, spec: GridSpec, gs: int) -> torch.Tensor:
    groups = w.float().reshape(-1, gs)
    scale, zero = fit_grid(groups, spec)
    return (dequantize(quantize(groups, scale, zero, spec.maxq), scale, zero) - groups).pow(2).sum(1)


@pytest.mark.parametrize("bits,sym", [(4, True), (3, False), (2, True)])
def test_mse_search_error_is_at_most_minmax_for_every_group(tiny_weights, bits, sym):
    for name, w in tiny_weights.items():
        plain = group_errors(w, GridSpec(bits, sym, min_zero=1), 64)
        searched = group_errors(w, GridSpec(bits, sym, min_zero=1, scale_search="mse"), 64)
        assert (searched <= plain).all(), name
        assert searched.sum() < 0.95 * plain.sum(), name  # and it finds shrinks that pay off
