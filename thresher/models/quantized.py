"""Load a GPTQ, AWQ or NF4 artifact into a PyTorch model whose quantized layers dequantize on the
fly, so every artifact can be evaluated on a CPU (transformers' own GPTQ/AWQ loading needs GPU
kernel packages, and its bitsandbytes loading leaves fused experts unquantized).

It reads the packed tensors through ``thresher.formats`` only, so evaluating an artifact needs
neither the compressors nor bitsandbytes.

Quantized linear layers become ``DequantLinear``, each at its own width when the GPTQ config has
per-module ``dynamic`` rules (mixed precision); each MoE layer's fused experts module becomes
``QuantizedExperts``, which holds every expert's three projections as ``DequantLinear`` and runs
the same routed loop as transformers' experts forward. A checkpoint pruned with a damage budget
(``layer_num_experts`` in its config) gets each MoE layer's own expert count.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from thresher.errors import ArtifactError
from thresher.formats.artifact import MANIFEST, STAGE_REPORTS
from thresher.formats.config import PackedFormat, packed_format
from thresher.models.adapters import EXPERT_ROLES, get_adapter
from thresher.models.checkpoint import CheckpointReader, CheckpointWriter
from thresher.models.layerwise import load_config

log = logging.getLogger(__name__)


class DequantLinear(nn.Module):
    """A linear layer kept in its packed form; the weight is rebuilt on every forward (unless
    ``dequantize_once`` kept it)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dequantize: Callable[[dict], torch.Tensor],
                 bias: torch.Tensor | None):
        super().__init__()
        self._names = list(tensors)
        for name, t in tensors.items():
            self.register_buffer(name.replace(".", "__"), t)
        self._dequantize = dequantize
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._kept: torch.Tensor | None = None  # the dequantized weight, once dequantize_once ran

    def packed(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "__")) for name in self._names}

    def weight_float(self) -> torch.Tensor:
        return self._dequantize(self.packed())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_float() if self._kept is None else self._kept
        return nn.functional.linear(x, w.to(x.dtype),
                                    None if self.bias is None else self.bias.to(x.dtype))


class QuantizedExperts(nn.Module):
    """Routed experts with quantized per-expert projections (transformers' experts interface)."""

    def __init__(self, gate: list[DequantLinear], up: list[DequantLinear],
                 down: list[DequantLinear],
                 glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.gate, self.up, self.down = nn.ModuleList(gate), nn.ModuleList(up), nn.ModuleList(down)
        self.glu = glu  # (gate x, up x) -> the down projection's input (Adapter.glu)
        self.num_experts = len(gate)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            mask = top_k_index == e
            rows = mask.any(dim=1).nonzero().squeeze(1)
            x = hidden_states[rows]
            h = self.glu(self.gate[e](x), self.up[e](x))
            gate = (top_k_weights * mask).sum(dim=1)[rows].unsqueeze(1)
            out.index_add_(0, rows, (self.down[e](h) * gate).to(out.dtype))
        return out


def dequantize_once(model: nn.Module) -> nn.Module:
    """Keep every ``DequantLinear``'s dequantized weight, so that a model scored on many batches
    unpacks each weight once instead of on every forward: the same weights and the same forward
    (a 64-expert model's forward otherwise spends most of its time unpacking), at the memory of
    the float weights. Returns ``model``."""
    for m in model.modules():
        if isinstance(m, DequantLinear):
            m._kept = m.weight_float()
    return model


def _dequantizer(fmt: PackedFormat) -> Callable[[dict], torch.Tensor]:
    return lambda t: fmt.format.dequantize(t, fmt.bits, fmt.group_size)


def _module_format(fmt: PackedFormat, key: str, path: Path) -> PackedFormat:
    """The layout of one packed module (its own width in a mixed-width GPTQ artifact)."""
    own = fmt.for_module(key)
    if own is None:
        raise ArtifactError(f"{path}: {key} is packed, but a '-:' rule of quantization_config."
                            "dynamic says it is not quantized")
    return own


def _quantized_modules(reader: CheckpointReader, fmt: PackedFormat,
                       names: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Disk module name -> its packed tensors (names relative to the module), for the modules
    among ``names`` (default: the whole checkpoint)."""
    names = reader.tensor_names() if names is None else names
    marker = "." + fmt.format.marker
    modules = [k.removesuffix(marker) for k in names if k.endswith(marker)]
    return {m: {n: reader.get(f"{m}.{n}") for n in fmt.format.tensors if f"{m}.{n}" in reader}
            for m in modules}


def _check_shape(path: Path, key: str, fmt: PackedFormat, t: dict[str, torch.Tensor], n: int,
                 k: int) -> None:
    """Refuse packed tensors that do not describe an [n, k] weight."""
    fmt.format.check(t, n, k, fmt.bits, fmt.group_size, f"{path}: {key}")


@torch.no_grad()
def load_quantized_model(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An eval-mode causal LM from a GPTQ / AWQ / NF4 artifact, dequantizing on the fly."""
    path = Path(path)
    config = load_config(path)
    fmt = packed_format(config, path)
    if fmt is None:
        raise ArtifactError(f"{path}: config.json has no quantization_config")
    del config.quantization_config
    adapter = get_adapter(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = CheckpointReader(path)
    reader.check_against_config(config)
    quantized = _quantized_modules(reader, fmt)
    packed_keys = {f"{m}.{n}" for m, ts in quantized.items() for n in ts}

    experts: dict[int, dict[tuple[int, str], DequantLinear]] = {}
    for key, tensors in quantized.items():
        bias_key = f"{key}.bias"
        bias = reader.get(bias_key).to(dtype) if bias_key in reader else None
        packed_keys.add(bias_key)
        mfmt = _module_format(fmt, key, path)
        module = DequantLinear(tensors, _dequantizer(mfmt), bias)
        expert = adapter.parse_disk_expert_key(key)
        if expert is not None:
            layer_idx, e, role = expert
            experts.setdefault(layer_idx, {})[(e, role)] = module
            continue
        name = adapter.memory_key_from_disk(key)
        try:
            target = model.get_submodule(name)
        except AttributeError:
            raise ArtifactError(f"{path}: quantized module {key} has no place in the model") from None
        _check_shape(path, key, mfmt, tensors, target.out_features, target.in_features)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)

    layers = adapter.layers(model)
    for i, mods in experts.items():
        n_layer = adapter.layer_num_experts(config, i)
        if n_layer != adapter.num_experts(config):  # a damage-budget prune: fewer experts here
            adapter.resize_experts(layers[i], n_layer)
        fused = adapter.experts(layers[i])
        n_exp = fused.down_proj.shape[0]
        hidden, inter = adapter.expert_view(layers[i], 0).down.shape
        missing = [(e, r) for e in range(n_exp) for r in EXPERT_ROLES if (e, r) not in mods]
        if missing:
            raise ArtifactError(f"{path}: layer {i} lacks quantized experts {missing[:4]}")
        for (e, r), mod in mods.items():
            n, k = (hidden, inter) if r == "down" else (inter, hidden)
            key = adapter.disk_expert_key(i, e, r)
            _check_shape(path, key, _module_format(fmt, key, path), mod.packed(), n, k)
        adapter.mlp(layers[i]).experts = QuantizedExperts(
            [mods[(e, "gate")] for e in range(n_exp)], [mods[(e, "up")] for e in range(n_exp)],
            [mods[(e, "down")] for e in range(n_exp)], adapter.glu(fused))

    plain = {adapter.memory_key_from_disk(k): reader.get(k).to(dtype)
             for k in reader.tensor_names() if k not in packed_keys}
    result = model.load_state_dict(plain, strict=False, assign=True)
    if result.unexpected_keys:
        raise ArtifactError(f"{path}: unexpected tensors {result.unexpected_keys[:5]}")
    tied = getattr(config, "tie_word_embeddings", False)
    if tied and adapter.disk_lm_head_key() + ".weight" not in plain:
        adapter.lm_head(model).weight = adapter.embeddings(model).weight
    with torch.device("cpu"):  # computed from the config, never stored in checkpoints
        adapter.set_rotary_embedding(model, type(adapter.rotary_embedding(model))(config=config))
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    still_meta += [n for n, b in model.named_buffers() if b.is_meta]
    if still_meta:
        raise ArtifactError(f"{path}: the artifact lacks {still_meta[:5]}")
    model.eval()
    return model


_NOT_COPIED = (MANIFEST, *STAGE_REPORTS, "config.json")


def _dequantized(reader: CheckpointReader, fmt: PackedFormat, path: Path, names: list[str]
                 ) -> dict[str, torch.Tensor]:
    """The artifact's tensors ``names``, each packed module's as its float32 weight."""
    quantized = _quantized_modules(reader, fmt, names)
    packed = {f"{m}.{n}" for m, ts in quantized.items() for n in ts}
    out = {f"{m}.weight": _dequantizer(_module_format(fmt, m, path))(ts).float().contiguous()
           for m, ts in quantized.items()}
    out.update((k, reader.get(k)) for k in names if k not in packed)
    return out


def _layer_groups(reader: CheckpointReader, adapter, num_layers: int) -> list[list[str]]:
    """The checkpoint's tensor names, one list for each decoder layer and one for the rest."""
    layers = [reader.with_prefix(adapter.disk_layer_prefix(i)) for i in range(num_layers)]
    inside = {k for names in layers for k in names}
    return [*layers, [k for k in reader.tensor_names() if k not in inside]]


@torch.no_grad()
def write_dequantized(path: str | Path, out_dir: str | Path) -> Path:
    """The GPTQ / AWQ / NF4 artifact at ``path`` as a plain checkpoint in ``out_dir`` in its
    family's hub layout (gpt-oss's experts fused again; config without quantization_config,
    tokenizer copied): the weights the artifact computes with, exactly (float32), for a tool that
    takes 16/32-bit checkpoints only (GGUF requantization, transformers). Streams one decoder
    layer at a time."""
    path, out_dir = Path(path), Path(out_dir)
    config = load_config(path)
    fmt = packed_format(config, path)
    if fmt is None:
        raise ArtifactError(f"{path}: config.json has no quantization_config; the checkpoint is "
                            "plain already")
    adapter = get_adapter(config)
    reader = CheckpointReader(path)
    writer = CheckpointWriter(out_dir)
    try:
        for names in _layer_groups(reader, adapter, int(config.num_hidden_layers)):
            writer.add(adapter.hub_experts(_dequantized(reader, fmt, path, names)))
            reader.close()
        writer.close()
    finally:
        reader.close()
    written = json.loads((path / "config.json").read_text())
    del written["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps(written, indent=2))
    for f in path.iterdir():
        if f.is_file() and ".safetensors" not in f.name and f.name not in _NOT_COPIED:
            shutil.copy2(f, out_dir / f.name)
    return out_dir
