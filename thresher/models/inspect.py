"""Size facts of a checkpoint directory without loading its weights."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from thresher.models.layerwise import load_config


def weight_bytes(path: str | Path) -> int:
    """Bytes of the weight files (safetensors) in a checkpoint directory."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def parameter_count(path: str | Path) -> int:
    """Logical parameters of the model the config describes (a quantized one counts as unpacked)."""
    config = copy.deepcopy(load_config(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # tied embeddings count once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
