"""Inputs the quantization-math tests share: correlated synthetic activations, and a trained
matrix of the tiny demo with the second moment of its real calibration inputs."""

import torch

from thresher.recipe import CalibrationConfig

CAL = CalibrationConfig(samples=4, seq_len=64)


def correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations [n, k] with correlated columns of unequal scale (what GPTQ exploits)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    return torch.randn(n, k, generator=gen) @ mix * torch.linspace(0.2, 2.0, k)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> float:
    """tr((W - W_hat) H (W - W_hat)^T): the squared output error over inputs of moment H."""
    diff = (w - w_hat).double()
    return float(((diff @ H.double()) * diff).sum())
