"""Trained matrices of the tiny demo with the second moments of their real calibration inputs."""

import pytest
import torch

from tests.quant.helpers import CAL
from thresher.export import compute_importance
from thresher.models.checkpoint import CheckpointReader

KEYS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"]


@pytest.fixture(scope="session")
def trained_layers(tiny_demo) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """key -> (weight [out, in] fp32, E[x x^T] [in, in] of its calibration inputs)."""
    importance = compute_importance(tiny_demo, CAL, show_progress=False, hessians=True)
    reader = CheckpointReader(tiny_demo)
    return {key: (reader.get(key).float(), torch.from_numpy(importance.hessian(key)))
            for key in KEYS}
