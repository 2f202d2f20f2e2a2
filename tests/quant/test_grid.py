"""The uniform grid and round-to-nearest: where the zero sits, RTN's half-step bound, and on the
trained tiny demo's weights the MSE scale search never losing to min-max."""

import pytest
import torch

from thresher.models import load_model
from thresher.quant.grid import GridSpec, dequantize, fit_grid, quantize
from thresher.quant.rtn import round_to_nearest


@pytest.fixture(scope="module")
def tiny_weights(tiny_demo):
    model = load_model(tiny_demo)
    layer = model.model.layers[1]
    return {"q_proj": layer.self_attn.q_proj.weight.detach(),
            "expert gate_up": layer.mlp.experts.gate_up_proj[3].detach(),
            "expert down": layer.mlp.experts.down_proj[3].detach()}


def test_grid_asymmetric_range_includes_zero_and_symmetric_zero_is_mid():
    w = torch.tensor([[0.5, 1.0, 2.0], [-3.0, -1.0, -0.5]])
    scale, zero = fit_grid(w, GridSpec(4, sym=False))
    assert torch.allclose(scale[:, 0], torch.tensor([2.0 / 15, 3.0 / 15]).half().float())
    assert zero[0, 0] == 0 and zero[1, 0] == 15  # min 0 and max 0 both representable
    _, zero = fit_grid(w, GridSpec(4, sym=True))
    assert (zero == 8).all()


@pytest.mark.parametrize("group_size", [-1, 32])
def test_rtn_rounds_each_weight_within_half_a_step_of_its_group_grid(tiny_weights, group_size):
    """Min-max grids never clip (up to the fp16 rounding of the scale), so every weight lands
    within half its (row, group) step of its code's value."""
    w = tiny_weights["q_proj"].float()
    spec = GridSpec(4, sym=False)
    codes, scales, zeros = round_to_nearest(w, spec, group_size)
    gs = w.shape[1] if group_size == -1 else group_size
    assert codes.dtype == torch.uint8 and int(codes.max()) <= spec.maxq
    assert scales.shape == zeros.shape == (w.shape[0], w.shape[1] // gs)
    step = scales.repeat_interleave(gs, dim=1)
    w_hat = step * (codes.float() - zeros.repeat_interleave(gs, dim=1).float())
    assert ((w - w_hat).abs() <= 0.5 * step * 1.01).all()


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
