"""Size facts of a checkpoint directory without loading its weights, and the refusal of a load
that cannot fit in this machine's memory (a clear error instead of the OOM killer's SIGKILL)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from thresher.errors import ModelError
from thresher.models.checkpoint import NOT_CARRIED_PREFIXES, CheckpointReader
from thresher.models.layerwise import load_config
from thresher.resources import available_memory

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors' floating-point dtype names


def weight_bytes(path: str | Path) -> int:
    """Bytes of the weight files (safetensors) in a checkpoint directory."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def parameter_count(path: str | Path) -> int:
    """Logical parameters of the model the config describes (a quantized one counts as unpacked)."""
    config = copy.deepcopy(load_config(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(config))


def count_parameters(model: torch.nn.Module) -> int:
    """A module's parameters; ``parameters()`` yields a tied weight (embeddings) once."""
    return sum(p.numel() for p in model.parameters())


def resident_bytes(path: str | Path, element_size: int) -> int:
    """A lower bound of the memory a checkpoint's tensors take once loaded: floating-point
    tensors at ``element_size`` bytes a value, the others (packed codes, integer scales) as
    stored; a multimodal checkpoint's vision tower and MTP block, which are not loaded, left out.
    What a load converts on top (a CPU kernel's repacked copy, MXFP4 or FP8 dequantized) only
    adds to it."""
    total = 0
    for header in CheckpointReader(path).headers.values():
        for name, info in header.items():
            if name == "__metadata__" or name.startswith(NOT_CARRIED_PREFIXES):
                continue
            if info["dtype"] in FLOAT_DTYPES:
                total += math.prod(info["shape"]) * element_size
            else:
                start, end = info["data_offsets"]
                total += end - start
    return total


def require_memory(need: int, subject: str, advice: str,
                   room: tuple[int, str] | None = None) -> None:
    """Raise ModelError when ``need`` bytes exceed ``room`` (bytes free, where they are; by
    default what this machine can still allocate, ``resources.available_memory``): the load
    would end part-way through, in the OOM killer's SIGKILL, which leaves no message, or in a
    device's out-of-memory error."""
    room = room or available_memory()
    if room is None or need <= room[0]:
        return
    raise ModelError(f"{subject} needs at least {size_text(need)} of memory; "
                     f"{size_text(room[0])} is available here ({room[1]}). {advice}")


def size_text(n: int) -> str:
    """Bytes as GiB (one decimal) from 1 GiB up, else MiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
