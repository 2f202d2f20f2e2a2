"""The Hessian of a layer's inputs and its damped inverse factor: token weights act like repeated
tokens, Kish's effective count, dead columns, the factor's identity, dampening retries and the
error that names the matrix."""

import logging

import pytest
import torch

from tests.quant.helpers import correlated_inputs
from thresher.errors import CompressionError
from thresher.quant.hessian import Hessian, inverse_factor, unit_dead_columns


def test_token_weights_scale_the_hessian_like_repeated_tokens():
    x = correlated_inputs(64, 16)
    weighted, repeated = Hessian(16), Hessian(16)
    weighted.add_batch(x, torch.full((64,), 2.0))
    repeated.add_batch(torch.cat([x, x]))
    torch.testing.assert_close(weighted.H, repeated.H)


def test_batches_accumulate_to_the_mean_of_all_tokens():
    x = correlated_inputs(300, 16)
    h = Hessian(16)
    for chunk in x.split(64):
        h.add_batch(chunk)
    torch.testing.assert_close(h.H, 2 * x.T @ x / 300, rtol=1e-5, atol=1e-6)
    assert h.tokens == 300


def test_effective_tokens_is_kish_of_the_token_weights():
    h = Hessian(8)
    h.add_batch(torch.randn(10, 8))
    assert h.effective_tokens == pytest.approx(10)
    skewed = Hessian(8)
    skewed.add_batch(torch.randn(10, 8), torch.tensor([1.0] + [0.01] * 9))
    assert skewed.effective_tokens == pytest.approx(1.09**2 / 1.0009)


def test_dead_columns_get_a_unit_diagonal_so_the_hessian_factors():
    x = correlated_inputs(256, 16)
    x[:, [3, 9]] = 0
    h = Hessian(16)
    h.add_batch(x)
    H = h.H.clone()
    dead = unit_dead_columns(H)
    assert dead.nonzero().flatten().tolist() == [3, 9]
    assert H[3, 3] == 1 and H[9, 9] == 1 and H[3, 9] == 0
    assert torch.isfinite(inverse_factor(H, 0.01, "w")).all()


def test_factor_is_the_upper_cholesky_factor_of_the_damped_inverse():
    h = Hessian(32)
    h.add_batch(correlated_inputs(512, 32))
    U = inverse_factor(h.H, 0.01, "w")
    damped = h.H + 0.01 * torch.diag(h.H).mean() * torch.eye(32)
    assert torch.equal(U, torch.triu(U))
    torch.testing.assert_close(U.T @ U, torch.linalg.inv(damped), rtol=1e-3, atol=1e-4)


def test_indefinite_hessian_is_retried_with_more_dampening(caplog):
    h = Hessian(16)
    h.add_batch(correlated_inputs(64, 16))
    H = h.H - 0.05 * torch.diag(h.H).mean() * torch.eye(16)  # 0.01 dampening is not enough
    with caplog.at_level(logging.WARNING):
        U = inverse_factor(H, 0.01, "model.layers.0.self_attn.q_proj")
    assert torch.isfinite(U).all()
    assert "q_proj: Hessian needed dampening" in caplog.text


def test_unfactorable_hessian_names_the_matrix():
    h = Hessian(16)
    h.add_batch(correlated_inputs(64, 16))
    h.H[0, 1] = h.H[1, 0] = float("nan")
    with pytest.raises(CompressionError, match=r"experts\.5\.gate_proj: .*not positive definite"):
        inverse_factor(h.H, 0.01, "model.layers.3.mlp.experts.5.gate_proj")
