"""Load a whole model (and its tokenizer) for evaluation; save one under canonical names."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from thresher.data.windows import calibration_windows
from thresher.errors import CheckpointError, DataError, ModelError, UnsupportedArchitectureError
from thresher.formats.dtypes import DTYPES
from thresher.models.adapters import get_adapter
from thresher.models.checkpoint import CheckpointReader
from thresher.models.inspect import require_memory, resident_bytes
from thresher.models.layerwise import LayerwiseModel, is_mxfp4, load_config
from thresher.models.manifest import verify_artifact
from thresher.models.quantized import load_quantized_model
from thresher.models.source import resolve_model

log = logging.getLogger(__name__)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:
        # transformers reads config.json first: a bad one is named as such
        if (Path(path) / "config.json").is_file():
            with contextlib.suppress(UnsupportedArchitectureError):
                load_config(path)
        check_tokenizer_files(path)
        raise ModelError(f"{path}: cannot load the tokenizer ({err})") from err


def check_tokenizer_files(path: str | Path) -> None:
    """Name a tokenizer file that is not JSON: transformers' and gguf's errors name no file."""
    for name in TOKENIZER_FILES:
        file = Path(path) / name
        try:
            if file.is_file():
                json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{file}: corrupt ({err}); replace it with a good copy") from None


def context_length(config) -> int | None:
    """The positions a model was trained for (its language config's max_position_embeddings),
    if its config states them."""
    with contextlib.suppress(UnsupportedArchitectureError):  # a family thresher does not know
        config = get_adapter(config).language_config(config)
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def check_window_length(config, seq_len: int, what: str, where: str) -> None:
    """Refuse windows longer than the model's context: past its trained positions a model's
    statistics (calibration) and perplexity (evaluation) describe a regime it is not used in."""
    n = context_length(config)
    if n is not None and seq_len > n:
        raise DataError(f"{what} {seq_len} is longer than {where}'s context ({n} positions, "
                        "max_position_embeddings); lower it")


def model_calibration_windows(model_dir: str | Path, calibration) -> torch.Tensor:
    """The calibration windows of ``calibration`` for the checkpoint at ``model_dir``: its
    tokenizer, and windows no longer than its context."""
    check_window_length(load_config(model_dir), calibration.seq_len, "calibration seq_len",
                        str(model_dir))
    return calibration_windows(load_tokenizer(model_dir), calibration)


def load_model(source: str | Path, dtype: torch.dtype | str = torch.float32) -> nn.Module:
    """Any model thresher can evaluate: a source string or directory -> an eval-mode causal LM."""
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    path = resolve_model(str(source))
    verify_artifact(path)  # a published artifact must match its manifest
    config = load_config(path)  # refuses unsupported families with the list of supported ones
    name = str(dtype).removeprefix("torch.")
    require_memory(resident_bytes(path, dtype.itemsize), f"loading {path} in {name}",
                   f"Evaluation holds the whole model in {name}; use a machine with more memory.")
    if is_mxfp4(config):
        return _load_layerwise(path, dtype)
    if getattr(config, "quantization_config", None) is not None:
        return load_quantized_model(path, dtype)
    if getattr(config, "layer_num_experts", None):
        return _load_layerwise(path, dtype)
    CheckpointReader(path).check_against_config(config)  # a bad file named, not a traceback
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model


def _load_layerwise(path: Path, dtype: torch.dtype) -> nn.Module:
    """A checkpoint whose MoE layers have different expert counts (pruned with a damage budget):
    transformers builds every layer with ``num_experts``, so the layers are resized and loaded
    one by one; or one with MXFP4 experts (gpt-oss), dequantized as each layer is read."""
    lw = LayerwiseModel(path, dtype)
    lw.load_outer()
    for i in range(lw.num_layers):
        lw.load_layer(i)
    lw.adapter.set_rotary_embedding(lw.model, lw.rotary)
    lw.model.eval()
    return lw.model


def save_model(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path) -> Path:
    """Save a full model in safetensors with hub-canonical (per-expert) names, plus its tokenizer.

    transformers 5's ``save_pretrained`` splits the fused expert tensors back into the per-expert
    keys that hub checkpoints and vLLM use; tests check that it stays so.
    """
    out = Path(out_dir)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
