"""GPTQ's one column loop, as both of its callers run it on a trained matrix of the tiny demo with
the second moment of its real calibration inputs: the uniform grids of ``compress.gptq`` and the
fixed per-value grids of ``export.block_gptq`` go through the same ``gptq_sweep``, give the same
result when the grid is the same, and beat rounding to nearest on the same grid."""

import pytest
import torch

from tests.quant.conftest import KEYS
from tests.quant.helpers import output_error
from thresher.compress import gptq as compress_gptq
from thresher.compress.rtn import rtn_quantize
from thresher.export import block_gptq
from thresher.quant import gptq_loop
from thresher.quant.grid import GridSpec
from thresher.quant.hessian import inverse_factor


def test_both_callers_use_the_one_loop():
    assert compress_gptq.gptq_sweep is gptq_loop.gptq_sweep
    assert block_gptq.gptq_sweep is gptq_loop.gptq_sweep


def gptq(weight: torch.Tensor, hessian: torch.Tensor, name: str) -> compress_gptq.GPTQ:
    g = compress_gptq.GPTQ(weight.shape[1], name)
    g.H = hessian.clone()
    return g


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("bits", [4, 3])
def test_same_grid_gives_the_same_codes_through_both_callers(trained_layers, key, bits):
    """compress's symmetric grid per (row, group of 32), fitted up front, is a fixed grid
    step * k with k in -zero .. maxq - zero; handed to the GGUF caller as its per-value grid, the
    loop picks the same integers and the same weights, bit for bit."""
    weight, hessian = trained_layers[key]
    spec = GridSpec(bits, sym=True, min_zero=1)
    qw, _ = gptq(weight, hessian, key).quantize(weight, spec, group_size=32)
    zero = (spec.maxq + 1) // 2
    assert (qw.zeros == zero).all()
    step = qw.scales.repeat_interleave(32, dim=1)
    ints, values = block_gptq.column_loop(weight, hessian, step, torch.zeros_like(step), -zero,
                                          spec.maxq - zero, 0.01, 128)
    assert torch.equal(torch.from_numpy(ints), qw.codes.int() - zero)
    assert torch.equal(torch.from_numpy(values), qw.dequantize())


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("options", [dict(), dict(act_order=True),
                                     dict(act_order=True, static_groups=False)])
def test_loop_beats_rounding_to_nearest_on_the_same_grids(trained_layers, key, options):
    """On the trained matrix and its real input moment, the output error of GPTQ's codes is
    below RTN's on the same (row, group) grids, with and without act-order and static groups."""
    weight, hessian = trained_layers[key]
    spec = GridSpec(3, sym=False, min_zero=1)
    qw, loss = gptq(weight, hessian, key).quantize(weight, spec, group_size=32, **options)
    rtn = rtn_quantize(weight, spec, 32)
    assert loss > 0
    assert output_error(weight, qw.dequantize(), hessian) < 0.9 * output_error(
        weight, rtn.dequantize(), hessian)


def test_identity_hessian_propagates_nothing(trained_layers):
    """With H = I the factor is diagonal, no error reaches another column, and the loop is
    rounding to nearest on the caller's grid."""
    weight, _ = trained_layers[KEYS[0]]
    step = torch.full_like(weight, 0.02)
    ints, values = block_gptq.column_loop(weight, torch.eye(weight.shape[1]), step,
                                          torch.zeros_like(step), -8, 7, 0.01, 128)
    expected = torch.round(weight / 0.02).clamp(-8, 7)
    assert torch.equal(torch.from_numpy(ints), expected.int())
    U = inverse_factor(torch.eye(4), 0.01, "identity")
    assert torch.equal(U, torch.diag(torch.diag(U)))
