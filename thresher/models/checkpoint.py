"""Reading and writing safetensors checkpoints under hub-canonical names, one layer at a time.

On disk, MoE experts are stored per expert (``model.layers.N.mlp.experts.E.gate_proj.weight``),
as hub checkpoints and vLLM expect; in memory, transformers 5 fuses them into 3-D parameters.
This module converts between the two for one decoder layer at a time, so a model larger than
memory can be streamed through calibration and written back shard by shard.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from thresher.errors import ModelError
from thresher.models.adapters import Adapter

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointReader:
    """Random access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE_NAME).is_file():
            with safe_open(self.path / SINGLE_NAME, framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_NAME)
        else:
            raise ModelError(f"{self.path}: no {SINGLE_NAME} or {INDEX_NAME}")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}

    def tensor_names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def get(self, key: str) -> torch.Tensor:
        try:
            file = self.weight_map[key]
        except KeyError:
            raise ModelError(f"{self.path}: checkpoint has no tensor {key!r}") from None
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(self.path / file, framework="pt")
            self._handles[file] = handle
        return handle.get_tensor(key)  # type: ignore[attr-defined]

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.weight_map if k.startswith(prefix)]


_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight$")


def read_layer_state(reader: CheckpointReader, adapter: Adapter, layer_idx: int, num_experts: int
                     ) -> dict[str, torch.Tensor]:
    """The in-memory state dict (keys relative to the layer) of decoder layer ``layer_idx``."""
    prefix = f"model.layers.{layer_idx}."
    names = dict(zip(adapter.spec.disk_expert_names, ("gate", "up", "down"), strict=True))
    per_expert: dict[tuple[int, str], torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for key in reader.with_prefix(prefix):
        m = _EXPERT_KEY.match(key)
        if m and m.group(2) == adapter.spec.disk_moe_prefix and m.group(4) in names:
            per_expert[(int(m.group(3)), names[m.group(4)])] = reader.get(key)
        else:
            state[adapter.memory_key_from_disk(key)[len(prefix) :]] = reader.get(key)
    if per_expert:
        missing = [(e, p) for e in range(num_experts) for p in ("gate", "up", "down")
                   if (e, p) not in per_expert]
        if missing:
            raise ModelError(f"{reader.path}: layer {layer_idx} lacks expert tensors {missing[:4]}...")
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[(e, "gate")], per_expert[(e, "up")]]) for e in range(num_experts)]
        )
        state["mlp.experts.down_proj"] = torch.stack([per_expert[(e, "down")] for e in range(num_experts)])
    return state


def canonical_layer_state(adapter: Adapter, layer_idx: int, state: dict[str, torch.Tensor]
                          ) -> dict[str, torch.Tensor]:
    """In-memory layer state (relative keys) -> hub-canonical absolute keys, experts split."""
    out: dict[str, torch.Tensor] = {}
    prefix = f"model.layers.{layer_idx}."
    disk_moe = adapter.spec.disk_moe_prefix
    for key, tensor in state.items():
        if key == "mlp.experts.gate_up_proj":
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[adapter.disk_expert_key(layer_idx, e, "gate") + ".weight"] = tensor[e, :inter]
                out[adapter.disk_expert_key(layer_idx, e, "up") + ".weight"] = tensor[e, inter:]
        elif key == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[adapter.disk_expert_key(layer_idx, e, "down") + ".weight"] = tensor[e]
        elif key.startswith("mlp.") and disk_moe != "mlp" and adapter.is_moe:
            out[prefix + disk_moe + key[len("mlp") :]] = tensor
        else:
            out[prefix + key] = tensor
    return out


class CheckpointWriter:
    """Writes tensors into size-capped safetensors shards plus the standard index file."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = tensors.items() if isinstance(tensors, dict) else tensors
        for key, tensor in items:
            t = tensor.detach().contiguous().cpu()
            self._pending[key] = t
            nbytes = t.numel() * t.element_size()
            self._pending_bytes += nbytes
            self._total_bytes += nbytes
        if self._pending_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, self.out_dir / name, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Flush and name the shards as transformers does (model-0000i-of-0000n)."""
        self._flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        if n == 1:
            (self.out_dir / "shard-00000.safetensors").rename(self.out_dir / SINGLE_NAME)
            return
        for i, keys in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.safetensors").rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
