"""Layer-by-layer access to a checkpoint: a weightless skeleton, one decoder layer materialized at a time.

Calibration (REAP observation, GPTQ, AWQ) walks the decoder layers in order and needs only the
current layer's weights and the activations flowing between layers. The skeleton is built on the
``meta`` device (no memory); ``load_layer`` reads one layer from the safetensors files and
``release_layer`` returns it to ``meta``. Peak weight memory is one layer plus the embeddings.
With a ``device`` (CUDA), each layer is read into host memory and moved there when its turn comes,
with the embeddings and the rotary tables; ``layer_to_host`` brings a finished layer back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from thresher.errors import CheckpointError, ModelError
from thresher.formats.config import packed_format
from thresher.models.adapters import Adapter, get_adapter
from thresher.models.checkpoint import CheckpointReader, read_layer_state


def release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc only; elsewhere a no-op).

    A layer's tensors are freed in many few-MB pieces that glibc keeps in its arenas, so without
    this the resident set grows by about a layer's size with every layer walked.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # mallopt parameter number, from glibc's malloc.h


def keep_large_blocks_off_heap(threshold: int = 1 << 20) -> None:
    """Give every allocation of ``threshold`` bytes or more its own mapping (glibc only).

    glibc raises its mmap threshold each time a mapped block is freed (up to 32 MB), after which
    layer-sized tensors come from the heap, where fragmentation holds pages that malloc_trim
    cannot return: GPTQ over 56 layers grew by about 300 MB that way in 2 of 3 runs. Setting the
    threshold fixes it, so large tensors go back to the OS when freed.
    """
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(_M_MMAP_THRESHOLD, threshold)


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def is_mxfp4(config) -> bool:
    """Whether ``config`` describes MXFP4 experts (gpt-oss on the hub), dequantized on read."""
    qc = getattr(config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return qc.get("quant_method") == "mxfp4"


def load_config(path: str | Path, dequantized: bool = False):
    """A checkpoint's config.json as transformers reads it; an unreadable one is named. With
    ``dequantized``, the config of the model as thresher reads it: MXFP4 experts are dequantized
    on read, so their quantization_config is dropped (a checkpoint written from it is plain)."""
    file = Path(path) / "config.json"
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = f"{type(err).__name__}: {err}"
        if file.is_file() and not _is_json_object(file):
            reason = "not a JSON object"
        raise CheckpointError(f"{file}: cannot read it ({reason})") from None
    # unsupported families fail here, before any weights are read; a multimodal hub config
    # gives way to its language model's
    config = get_adapter(config).language_config(config)
    _check_sizes(config, file)
    if dequantized and is_mxfp4(config):
        del config.quantization_config
    return config


# sizes a model cannot have as zero or less (transformers accepts them and fails deep inside)
POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
                  "num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok",
                  "max_position_embeddings")


def _is_json_object(file: Path) -> bool:
    try:
        return isinstance(json.loads(file.read_text()), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def _check_sizes(config, file: Path) -> None:
    for name in POSITIVE_SIZES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise CheckpointError(f"{file}: {name} is {value}; it must be positive")


def refuse_packed(config, path: str | Path) -> None:
    """A quantized checkpoint named as the input of a stage that reads 16/32-bit weights (the
    layer-wise reader, and the recipe check before a run whose variants have stages)."""
    packed = packed_format(config, path)
    if packed is not None:
        kind = "NF4" if packed.kind == "nf4" else f"{packed.kind.upper()} {packed.bits}-bit"
        raise ModelError(f"{path}: holds {kind} weights; pruning, merging, quantizing and "
                         "an importance matrix read 16- or 32-bit ones: give the model it was "
                         "quantized from")


class LayerwiseModel:
    """A causal LM whose decoder layers are materialized one at a time from disk."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.path = Path(path)
        self.dtype = dtype
        self.device = torch.device(device)
        self.config = load_config(self.path, dequantized=True)
        refuse_packed(self.config, self.path)
        self.adapter: Adapter = get_adapter(self.config)
        self.config._attn_implementation = self.adapter.attention_implementation
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=dtype)
        self.model.eval()
        self.reader = CheckpointReader(self.path)
        self.reader.check_against_config(self.config)
        with torch.device("cpu"):
            rotary_cls = type(self.adapter.decoder(self.model).rotary_emb)
            self.rotary = rotary_cls(config=self.config)
        self.rotary.to(self.device)
        self._resident: set[int] = set()

    @property
    def num_layers(self) -> int:
        return len(self.adapter.layers(self.model))

    def layer(self, i: int) -> nn.Module:
        return self.adapter.layers(self.model)[i]

    # -- materialization ----------------------------------------------------------------------

    def load_layer(self, i: int) -> nn.Module:
        """Read decoder layer ``i`` from disk into memory and return it."""
        layer = self.layer(i)
        num_experts = self.adapter.layer_num_experts(self.config, i)
        if self.adapter.is_moe_layer(layer) and num_experts != self.adapter.num_experts(self.config):
            self.adapter.resize_experts(layer, num_experts)
        state = read_layer_state(self.reader, self.adapter, i, num_experts, self.dtype)
        if self.device.type != "cpu":
            state = {k: v.to(self.device) for k, v in state.items()}
        layer.load_state_dict(state, strict=True, assign=True)
        self.reader.close()
        self._resident.add(i)
        return layer

    def layer_to_host(self, i: int) -> nn.Module:
        """Move resident layer ``i`` to host memory (for writing it) and return it."""
        return self.layer(i).to("cpu")

    def release_layer(self, i: int) -> None:
        """Drop layer ``i``'s weights (back to the meta device) and hand the memory back."""
        self.layer(i).to("meta")
        self._resident.discard(i)
        release_free_memory()

    def resident_layers(self) -> list[int]:
        """Indices of decoder layers whose weights are in memory (checked on the tensors)."""
        return [
            i for i in range(self.num_layers)
            if any(not p.is_meta for p in self.layer(i).parameters())
        ]

    def load_outer(self) -> None:
        """Materialize the embeddings, the final norm and the LM head (small next to the layers)."""
        emb = self.adapter.embeddings(self.model)
        emb.load_state_dict({"weight": self._outer("model.embed_tokens.weight")}, assign=True)
        norm = self.adapter.final_norm(self.model)
        norm.load_state_dict({"weight": self._outer("model.norm.weight")}, assign=True)
        head = self.adapter.lm_head(self.model)
        if "lm_head.weight" in self.reader:
            head.load_state_dict({"weight": self._outer("lm_head.weight")}, assign=True)
        else:  # tied embeddings
            head.weight = emb.weight

    def _outer(self, name: str) -> torch.Tensor:
        return self.reader.get(name).to(self.device, self.dtype)

    # -- computation --------------------------------------------------------------------------

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.adapter.embeddings(self.model)(input_ids.to(self.device))

    def position_embeddings(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(hidden.shape[1], device=hidden.device)
        pos = pos.unsqueeze(0).expand(hidden.shape[0], -1)
        return self.rotary(hidden, pos)

    @torch.no_grad()
    def layer_forward(self, i: int, hidden: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
        """Run resident layer ``i`` on ``hidden`` [B, S, H] with a causal mask."""
        if position_embeddings is None:
            position_embeddings = self.position_embeddings(hidden)
        mask = self.adapter.layer_attention_mask(self.config, i, hidden)
        out = self.layer(i)(hidden, attention_mask=mask, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.adapter.lm_head(self.model)(self.adapter.final_norm(self.model)(hidden))
