"""Reading and writing safetensors checkpoints under hub-canonical names, one layer at a time.

On disk, MoE experts are stored per expert (``model.layers.N.mlp.experts.E.gate_proj.weight``),
as hub checkpoints and vLLM expect; in memory, transformers 5 fuses them into 3-D parameters.
This module converts between the two for one decoder layer at a time, so a model larger than
memory can be streamed through calibration and written back shard by shard.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM

from thresher.errors import CheckpointError, ModelError
from thresher.formats.dtypes import SAFETENSORS_DTYPES
from thresher.models import mxfp4
from thresher.models.adapters import (
    DISK_LAYERS,
    EXPERT_ROLES,
    MEMORY_DOWN,
    MEMORY_EXPERTS_PREFIX,
    MEMORY_GATE_UP,
    Adapter,
    get_adapter,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# A multimodal hub checkpoint (Qwen3.5-MoE) keeps its language model under this prefix; the
# reader shows those tensors under the causal LM's names (``model.layers.N...``) and leaves out
# the parts thresher does not carry: the vision tower and the multi-token-prediction block.
LANGUAGE_MODEL_PREFIX = "model.language_model."
NOT_CARRIED_PREFIXES = ("model.visual.", "mtp.")
# Its experts may be stored fused as transformers 5 holds them ([E, 2I, H] gate|up, [E, H, I]
# down); the reader shows them one expert at a time under the per-expert names.
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")

log = logging.getLogger(__name__)


# Bytes per element of the safetensors dtypes (the names the header spells).
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_MAX_HEADER = 100 << 20  # the safetensors library's own cap on the JSON header


def read_safetensors_header(file: Path) -> dict[str, dict]:
    """The tensor table of one safetensors file, after checking that it describes the file.

    Reads the header only (no tensor data). A header that is not a safetensors header, or tensor
    data that runs past the end of the file (a truncated copy), raises a CheckpointError naming
    the file, instead of the safetensors library's bare "header too large".
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            raw = f.read(length) if 0 < length <= min(size - 8, _MAX_HEADER) else b""
    except OSError as err:
        raise CheckpointError(f"{file}: cannot read it ({err.strerror or err})") from None
    if length < 0:
        raise CheckpointError(f"{file}: truncated: {size} bytes, too short for a safetensors "
                              "header")
    if not raw:
        raise CheckpointError(f"{file}: corrupt safetensors header (it claims {length} bytes; the "
                              f"file has {size}); replace the file with a good copy")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file}: corrupt safetensors header (not JSON: {err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a table of tensors)")
    header.pop("__metadata__", None)
    end = 0
    for key, entry in header.items():
        try:
            start, stop = entry["data_offsets"]
            shape = [int(n) for n in entry["shape"]]
            dtype = entry["dtype"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors header (entry {key!r})") from None
        item = _ITEM_BYTES.get(dtype)
        if item is not None and stop - start != item * math.prod(shape):
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {key!r} ({dtype} "
                                  f"{shape}) spans {stop - start} bytes")
        end = max(end, stop)
    available = size - 8 - length
    if end > available:
        raise CheckpointError(f"{file}: truncated: its tensors need {end} bytes of data, the file "
                              f"holds {max(available, 0)}; replace the file with a complete copy")
    return header


class CheckpointReader:
    """Random access to the tensors of a (possibly sharded) safetensors checkpoint.

    Every file's header is checked when the reader opens (corrupt, truncated), so a bad file is
    named before any computation starts; ``check_against_config`` compares the tensors' shapes
    and dtypes with what config.json makes of them.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                weight_map = {str(k): str(v) for k, v in weight_map.items()}
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                    AttributeError) as err:
                raise CheckpointError(f"{index}: corrupt index file ({type(err).__name__}: {err})"
                                      ) from None
        elif (self.path / SINGLE_NAME).is_file():
            weight_map = None
        else:
            raise ModelError(f"{self.path}: no {SINGLE_NAME} or {INDEX_NAME}")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_NAME]
        self.headers: dict[str, dict[str, dict]] = {}
        for name in files:
            if not (self.path / name).is_file():
                raise CheckpointError(f"{self.path / name}: missing (listed in {INDEX_NAME})")
            self.headers[name] = read_safetensors_header(self.path / name)
        if weight_map is None:
            weight_map = dict.fromkeys(self.headers[SINGLE_NAME], SINGLE_NAME)
        for key, name in weight_map.items():
            if key not in self.headers[name]:
                raise CheckpointError(f"{self.path / name}: has no tensor {key!r}, which "
                                      f"{INDEX_NAME} places there")
        self._stored: dict[str, str] = {}  # name shown -> name in the file, where they differ
        # per-expert name -> (fused name shown, expert, rows of it): a hub's fused experts
        self._views: dict[str, tuple[str, int, slice]] = {}
        self._fused: dict[str, torch.Tensor] = {}  # fused tensors read for the current layer
        self.weight_map: dict[str, str] = self._language_model_names(weight_map)
        self._handles: dict[str, object] = {}

    def _language_model_names(self, weight_map: dict[str, str]) -> dict[str, str]:
        """``weight_map`` under the causal LM's names: a multimodal checkpoint's
        ``model.language_model.*`` tensors as ``model.*``, its vision tower and MTP block left
        out (logged); any other checkpoint unchanged."""
        if not any(k.startswith(LANGUAGE_MODEL_PREFIX) for k in weight_map):
            return weight_map
        out: dict[str, str] = {}
        dropped = 0
        for key, file in weight_map.items():
            if key.startswith(NOT_CARRIED_PREFIXES):
                dropped += 1
                continue
            name = key
            if key.startswith(LANGUAGE_MODEL_PREFIX):
                name = "model." + key[len(LANGUAGE_MODEL_PREFIX):]
                self._stored[name] = key
            fused = _FUSED_EXPERTS.fullmatch(name)
            if fused is None:
                out[name] = file
                continue
            self._stored[name] = key
            experts, second = self.headers[file][key]["shape"][:2]
            parts = ((("down_proj", slice(None)),) if fused.group(2) == "down_proj" else
                     (("gate_proj", slice(0, second // 2)), ("up_proj", slice(second // 2, None))))
            for e in range(experts):
                for proj, rows in parts:
                    view = f"{fused.group(1)}.{e}.{proj}.weight"
                    self._views[view] = (name, e, rows)
                    out[view] = file
        if dropped:
            log.info("%s: reading the language model only; %d tensors of the vision tower and "
                     "the multi-token-prediction block are not carried", self.path, dropped)
        return out

    def tensor_names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def get(self, key: str) -> torch.Tensor:
        if key in self._views:
            fused, e, rows = self._views[key]
            if fused not in self._fused:  # read once per layer: its experts come one by one
                layer = fused.rsplit(".", 1)[0]
                self._fused = {k: v for k, v in self._fused.items()
                               if k.rsplit(".", 1)[0] == layer}
                self._fused[fused] = self._handle(key).get_tensor(self._stored[fused])
            return self._fused[fused][e, rows].clone()
        try:
            return self._handle(key).get_tensor(self._stored.get(key, key))  # type: ignore[attr-defined]
        except SafetensorError as err:
            raise CheckpointError(f"{self.path / self.weight_map[key]}: cannot read tensor "
                                  f"{key!r} ({err})") from None

    def _handle(self, key: str):
        """The open safetensors file that holds ``key``."""
        try:
            file = self.weight_map[key]
        except KeyError:
            raise ModelError(f"{self.path}: checkpoint has no tensor {key!r}") from None
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(self.path / file, framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{self.path / file}: cannot open it ({err})") from None
            self._handles[file] = handle
        return handle

    def entry(self, key: str) -> dict:
        """The header entry of tensor ``key``: dtype (safetensors' name), shape, offsets (one
        expert of a fused tensor: its dtype and shape)."""
        if key in self._views:
            fused, _, rows = self._views[key]
            entry = self.headers[self.weight_map[key]][self._stored[fused]]
            _, out_rows, cols = entry["shape"]
            return {"dtype": entry["dtype"], "shape": [len(range(out_rows)[rows]), cols]}
        return self.headers[self.weight_map[key]][self._stored.get(key, key)]

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor ``key``, read from the file header without loading its data."""
        if key not in self.weight_map:
            raise ModelError(f"{self.path}: checkpoint has no tensor {key!r}")
        return tuple(self.entry(key)["shape"])

    def close(self) -> None:
        """Close the open files. Their pages are mapped into this process and count toward its
        resident set until closed, so a layer-by-layer walk closes them after every layer."""
        self._handles.clear()
        self._fused.clear()

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.weight_map if k.startswith(prefix)]

    def check_against_config(self, config,
                             expected: dict[str, tuple[int, ...]] | None = None) -> None:
        """Refuse a tensor whose shape or dtype differs from what ``config`` makes of it.

        Each tensor is compared with ``expected_tensors(config)`` (pass it when already made);
        packed modules (GPTQ, AWQ, NF4) are their readers' to check. Only headers are read.
        """
        expected = expected_tensors(config) if expected is None else expected
        packed = {k.rsplit(".", 1)[0] for k in self.weight_map if k.endswith(".qweight")}
        packed |= {k.split(".weight.", 1)[0] for k in self.weight_map if ".weight." in k}
        for key in self.weight_map:
            if key not in expected or key.rsplit(".", 1)[0] in packed:
                continue
            entry, want = self.entry(key), expected[key]
            file = self.path / self.weight_map[key]
            if tuple(entry["shape"]) != want:
                raise CheckpointError(f"{file}: tensor {key!r} has shape {list(entry['shape'])}, "
                                      f"config.json makes it {list(want)}")
            if entry["dtype"] not in _FLOAT_DTYPES:
                raise CheckpointError(f"{file}: tensor {key!r} has dtype {entry['dtype']}, not a "
                                      "floating-point dtype")


def expected_tensors(config) -> dict[str, tuple[int, ...]]:
    """On-disk tensor name -> shape, for the unquantized model that ``config`` describes: each
    parameter of a weightless (meta) model built from it, per-expert tensors as one slice of the
    fused experts."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    adapter = get_adapter(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = adapter.layers(model)
    out: dict[str, tuple[int, ...]] = {}
    for i, layer in enumerate(layers):
        count = adapter.layer_num_experts(config, i) if adapter.is_moe else 0
        if adapter.is_moe_layer(layer) and count != adapter.num_experts(config):
            adapter.resize_experts(layer, count)
        state = canonical_layer_state(adapter, i, dict(layer.state_dict()))
        out.update({k: tuple(t.shape) for k, t in state.items()})
    outer = {k: t for k, t in model.state_dict().items() if not k.startswith(DISK_LAYERS + ".")}
    out.update({adapter.disk_key_from_memory(k): tuple(t.shape) for k, t in outer.items()})
    return out


def read_layer_state(reader: CheckpointReader, adapter: Adapter, layer_idx: int, num_experts: int,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The in-memory state dict (keys relative to the layer) of decoder layer ``layer_idx``.

    Floating tensors are converted to ``dtype`` when given. Experts are copied one at a time into
    preallocated fused tensors, so reading a layer holds about one copy of it, not three. MXFP4
    weights (``<name>_blocks`` with ``<name>_scales``, gpt-oss on the hub) are dequantized.
    """
    prefix = adapter.disk_layer_prefix(layer_idx)
    expert_keys: dict[tuple[int, str], str] = {}
    state: dict[str, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    for key in reader.with_prefix(prefix):
        expert = adapter.parse_disk_expert_key(key.removesuffix(".weight"))
        if key.endswith(mxfp4.SCALES_SUFFIX):
            continue  # read beside its blocks
        if key.endswith(mxfp4.BLOCKS_SUFFIX):
            name = key.removesuffix(mxfp4.BLOCKS_SUFFIX)
            state[adapter.memory_key_from_disk(name)[len(prefix):]] = _read_mxfp4(
                reader, name, dtype or torch.bfloat16)
        elif expert is not None and key.endswith(".weight"):
            expert_keys[expert[1:]] = key
        else:
            state[adapter.memory_key_from_disk(key)[len(prefix) :]] = convert(reader.get(key))
    if expert_keys:
        missing = [(e, p) for e in range(num_experts) for p in EXPERT_ROLES
                   if (e, p) not in expert_keys]
        if missing:
            raise ModelError(f"{reader.path}: layer {layer_idx} lacks expert tensors {missing[:4]}...")
        for e in range(num_experts):
            gate, up, down = (reader.get(expert_keys[(e, p)]) for p in EXPERT_ROLES)
            if e == 0:  # the fused tensors take their shapes from the first expert
                inter = gate.shape[0]
                fused_dtype = dtype if dtype is not None else gate.dtype
                gate_up = torch.empty(num_experts, 2 * inter, gate.shape[1], dtype=fused_dtype)
                down_all = torch.empty(num_experts, *down.shape, dtype=fused_dtype)
            gate_up[e, :inter] = gate
            gate_up[e, inter:] = up
            down_all[e] = down
        state[MEMORY_GATE_UP] = gate_up
        state[MEMORY_DOWN] = down_all
    return state


def _read_mxfp4(reader: CheckpointReader, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight ``name`` from its ``_blocks`` and ``_scales`` tensors."""
    scales = name + mxfp4.SCALES_SUFFIX
    file = reader.path / reader.weight_map[name + mxfp4.BLOCKS_SUFFIX]
    if scales not in reader:
        raise CheckpointError(f"{file}: MXFP4 tensor {name}{mxfp4.BLOCKS_SUFFIX} has no "
                              f"{scales} beside it; the checkpoint is incomplete")
    return mxfp4.dequantize(reader.get(name + mxfp4.BLOCKS_SUFFIX), reader.get(scales), dtype,
                            f"{file}: {name}")


def canonical_layer_state(adapter: Adapter, layer_idx: int, state: dict[str, torch.Tensor],
                          per_expert: bool = False) -> dict[str, torch.Tensor]:
    """In-memory layer state (relative keys) -> hub-canonical absolute keys, experts split
    (kept fused for families whose hub checkpoints keep them so, unless ``per_expert``: the
    per-expert modules of a quantized checkpoint)."""
    out: dict[str, torch.Tensor] = {}
    prefix = adapter.disk_layer_prefix(layer_idx)
    if adapter.fused_experts_on_disk:
        fused = {k: v for k, v in state.items() if k.startswith(MEMORY_EXPERTS_PREFIX)}
        state = {k: v for k, v in state.items() if k not in fused}
        if per_expert and fused:
            out.update(adapter.per_expert_state(layer_idx, fused))
        else:
            out.update({adapter.disk_key_from_memory(prefix + k): v for k, v in fused.items()})
    for key, tensor in state.items():
        if key == MEMORY_GATE_UP:
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[adapter.disk_expert_key(layer_idx, e, "gate") + ".weight"] = tensor[e, :inter]
                out[adapter.disk_expert_key(layer_idx, e, "up") + ".weight"] = tensor[e, inter:]
        elif key == MEMORY_DOWN:
            for e in range(tensor.shape[0]):
                out[adapter.disk_expert_key(layer_idx, e, "down") + ".weight"] = tensor[e]
        else:
            out[adapter.disk_key_from_memory(prefix + key)] = tensor
    return out


class _ShardStream:
    """One safetensors file written as tensors arrive: data goes to a side file at once, and
    ``close`` writes the header (8-byte length, JSON of dtypes, shapes and offsets) and the data."""

    def __init__(self, path: Path):
        self.path = path
        self.data_path = path.with_name(path.name + ".data")
        self._data = open(self.data_path, "wb")  # noqa: SIM115 - closed in close()
        self.header: dict[str, dict] = {}
        self.nbytes = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        if key in self.header:
            raise ModelError(f"{self.path}: tensor {key!r} written twice")
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self._data.write(memoryview(raw))
        size = t.numel() * t.element_size()
        self.header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [self.nbytes, self.nbytes + size]}
        self.nbytes += size

    def close(self) -> None:
        self._data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header},
                            separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 16 << 20)
        self.data_path.unlink()


class CheckpointWriter:
    """Writes tensors into size-capped safetensors shards plus the standard index file.

    Tensors are streamed to disk as they are added, so writing a checkpoint holds no more than
    the tensors the caller passes in at once, whatever the shard size.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._shard: _ShardStream | None = None
        self._shards: list[list[str]] = []
        self._total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = tensors.items() if isinstance(tensors, dict) else tensors
        for key, tensor in items:
            if self._shard is None:
                name = f"shard-{len(self._shards):05d}.safetensors"
                self._shard = _ShardStream(self.out_dir / name)
            self._shard.add(key, tensor)
            self._total_bytes += tensor.numel() * tensor.element_size()
        if self._shard is not None and self._shard.nbytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._shard is None:
            return
        self._shard.close()
        self._shards.append(list(self._shard.header))
        self._shard = None

    def close(self) -> None:
        """Finish the last shard and name the shards as transformers does (model-0000i-of-0000n)."""
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
