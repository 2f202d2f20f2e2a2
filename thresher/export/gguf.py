"""GGUF export: a thresher checkpoint as one GGUF file for llama.cpp and Ollama.

Families: Qwen3-MoE (llama.cpp's ``qwen3moe``), Qwen2-MoE (``qwen2moe``, with its shared
expert), Mixtral (``llama`` with experts), OLMoE (``olmoe``), GLM-4.5 (``glm4moe``: dense leading
layers, shared experts, the sigmoid router's correction bias as ``exp_probs_b``), DeepSeek-V3 and
Kimi-K2 (``deepseek2``: GLM's router with multi-head latent attention, kv_b split into
``attn_k_b``/``attn_v_b`` as llama.cpp's absorbed MLA reads it), ERNIE-4.5-MoE (``ernie4_5-moe``:
its [1, E] selection bias as ``exp_probs_b``, the MoE layer step as metadata) and the dense Llama, Qwen3 and
Qwen2 (``llama``, ``qwen3``, ``qwen2``); llama.cpp's llama graph wants q/k rows in its rotary
layout.

GGUF names tensors by role (``blk.3.attn_q.weight``) and stacks each layer's experts into one 3-D
tensor per projection (``blk.3.ffn_gate_exps.weight``, [E, I, H] in row-major order); its
metadata carries the hyperparameters llama.cpp builds its graph from and the whole tokenizer. The
``gguf`` package (llama.cpp's own Python writer) supplies the container, the architecture and
tensor names, the metadata keys and the plain block quantizers (Q8_0, Q4_0, Q4_1, Q5_0);
``block_quants`` has the K-quants and the importance-weighted ones, and ``imatrix`` collects the
importance from the calibration windows.

A plain 16/32-bit checkpoint (base or REAP-pruned: its config simply has fewer experts) is
quantized to the ``--type``; a GPTQ/AWQ artifact with 4-bit codes in groups of 32 is handed to
Q4_1 as it is (its codes and scales are the blocks'). The file is written in two passes so that
memory stays near one stacked expert tensor: the tensor table is declared from the checkpoint's
headers, then each tensor is read, converted and written in turn.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from thresher.errors import ExportError, UnsupportedArchitectureError
from thresher.export.block_gptq import GPTQ_TYPES, gptq_quantize
from thresher.export.block_quants import IMPORTANCE_WEIGHTED, QK_K, quantize
from thresher.export.gguf_convert import Conversion, plan_deltanet, write_deltanet_metadata
from thresher.export.imatrix import ImportanceMatrix
from thresher.formats.config import PackedFormat, packed_format
from thresher.models.adapters import Adapter, get_adapter
from thresher.models.checkpoint import CheckpointReader, CheckpointWriter
from thresher.models.layerwise import load_config
from thresher.models.loading import check_tokenizer_files
from thresher.paths import storage_error
from thresher.resources import measure

log = logging.getLogger(__name__)

QType = gguf.GGMLQuantizationType
Role = gguf.MODEL_TENSOR



@dataclass(frozen=True)
class GGUFType:
    """One ``--type``: llama.cpp's file type and its base block type. Which tensors take another
    type (the output head, attn_v, ffn_down, ...) follows llama.cpp's llama_tensor_get_type for
    that file type; see ``tensor_type``."""

    default: QType
    file_type: gguf.LlamaFileType


_FT = gguf.LlamaFileType
GGUF_TYPES: dict[str, GGUFType] = {
    "f32": GGUFType(QType.F32, _FT.ALL_F32),
    "f16": GGUFType(QType.F16, _FT.MOSTLY_F16),
    "bf16": GGUFType(QType.BF16, _FT.MOSTLY_BF16),
    "q8_0": GGUFType(QType.Q8_0, _FT.MOSTLY_Q8_0),
    "q6_k": GGUFType(QType.Q6_K, _FT.MOSTLY_Q6_K),
    "q5_0": GGUFType(QType.Q5_0, _FT.MOSTLY_Q5_0),
    "q4_1": GGUFType(QType.Q4_1, _FT.MOSTLY_Q4_1),
    "q4_0": GGUFType(QType.Q4_0, _FT.MOSTLY_Q4_0),
    "q4_k": GGUFType(QType.Q4_K, _FT.MOSTLY_Q4_K_S),
    "q4_k_m": GGUFType(QType.Q4_K, _FT.MOSTLY_Q4_K_M),
    "q3_k": GGUFType(QType.Q3_K, _FT.MOSTLY_Q3_K_S),
    "q3_k_m": GGUFType(QType.Q3_K, _FT.MOSTLY_Q3_K_M),
}
# The GPTQ/AWQ hand-off: Q4_1 blocks as the artifact has them; the embeddings and head it keeps in
# 16 bits take llama.cpp's Q4_1 types, any other 16-bit matrix (none in a full quantize) stays F16.
HANDOFF_TYPE = GGUFType(QType.Q4_1, _FT.MOSTLY_Q4_1)
# llama.cpp's tensor_type_fallback for a K-quant tensor whose rows are not whole super-blocks
# (older llama.cpp releases gave Q3_K rows IQ4_NL; the one llama-cpp-python 0.3.36 ships, Q4_0).
_K_FALLBACK = {QType.Q3_K: QType.Q4_0, QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1,
               QType.Q6_K: QType.Q8_0}
_FFN_DOWN_ROLES = frozenset({Role.FFN_DOWN, Role.FFN_DOWN_EXP, Role.FFN_DOWN_SHEXP})
_K_MIXES = frozenset({_FT.MOSTLY_Q3_K_S, _FT.MOSTLY_Q3_K_M, _FT.MOSTLY_Q4_K_S, _FT.MOSTLY_Q4_K_M})
_UNQUANTIZED_FILES = frozenset({_FT.ALL_F32, _FT.MOSTLY_F16, _FT.MOSTLY_BF16})
HANDOFF_GROUP = 32  # a Q4_1 block: the group size a GPTQ/AWQ artifact needs to export losslessly
_PLAIN_NUMPY = {QType.F32: np.float32, QType.F16: np.float16}  # stored as numpy arrays, not bytes


@dataclass(frozen=True)
class GGUFArchitecture:
    """What llama.cpp's graph for one thresher family assumes about the checkpoint."""

    arch: gguf.MODEL_ARCH
    renormalizes_top_k: bool | None = None  # MoE: llama.cpp renormalizes the top-k gate weights
    permute_qk: bool = False  # llama.cpp's llama graph rotates interleaved pairs, HF halves
    post_attention_norm: Role = Role.FFN_NORM  # glm4moe: post_attention_norm
    # the router's rule travels as metadata (gating function, weights scale and norm, groups)
    router_metadata: bool = False
    rope_types: tuple[str, ...] = ("default",)  # the config's rope types llama.cpp's graph takes
    # which layers are MoE travels as metadata (dense leading layers, the MoE layer step)
    moe_layout_metadata: bool = False
    # Gated DeltaNet layers between full-attention ones (qwen35moe), see export/gguf_convert.py
    hybrid: bool = False


# Keyed by the adapter's model_type. Mixtral runs on llama.cpp's llama graph (with experts).
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "qwen3_moe": GGUFArchitecture(gguf.MODEL_ARCH.QWEN3MOE, renormalizes_top_k=True),
    "qwen2_moe": GGUFArchitecture(gguf.MODEL_ARCH.QWEN2MOE, renormalizes_top_k=False),
    "mixtral": GGUFArchitecture(gguf.MODEL_ARCH.LLAMA, renormalizes_top_k=True, permute_qk=True),
    "olmoe": GGUFArchitecture(gguf.MODEL_ARCH.OLMOE, renormalizes_top_k=False),
    "glm4_moe": GGUFArchitecture(gguf.MODEL_ARCH.GLM4_MOE, post_attention_norm=Role.ATTN_POST_NORM,
                                 router_metadata=True),
    "deepseek_v3": GGUFArchitecture(gguf.MODEL_ARCH.DEEPSEEK2, router_metadata=True,
                                    rope_types=("default", "yarn")),
    # gpt-oss: softmax over the selected logits is the renormalized softmax of the top-k
    "gpt_oss": GGUFArchitecture(gguf.MODEL_ARCH.GPT_OSS, renormalizes_top_k=False,
                                post_attention_norm=Role.ATTN_POST_NORM,
                                rope_types=("default", "yarn")),
    # ERNIE-4.5: llama.cpp's graph rotates adjacent pairs, as the checkpoint does (no permute)
    "ernie4_5_moe": GGUFArchitecture(gguf.MODEL_ARCH.ERNIE4_5_MOE, renormalizes_top_k=True,
                                     moe_layout_metadata=True),
    # Qwen3.5-MoE: Gated DeltaNet and gated full attention (q_proj's query and gate per head, as
    # the checkpoint has them), renormalized softmax routing, a sigmoid-gated shared expert
    "qwen3_5_moe_text": GGUFArchitecture(gguf.MODEL_ARCH.QWEN35MOE, renormalizes_top_k=True,
                                         post_attention_norm=Role.ATTN_POST_NORM, hybrid=True),
    "llama": GGUFArchitecture(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "qwen3": GGUFArchitecture(gguf.MODEL_ARCH.QWEN3),
    "qwen2": GGUFArchitecture(gguf.MODEL_ARCH.QWEN2),
}

# Qwen2's pre-tokenizer regex (Qwen2, Qwen2.5, Qwen3 and their MoEs), as tokenizer.json spells it.
QWEN2_PRE_TOKENIZER_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Kept in F32 whatever the file type, as llama.cpp's converter does (1-D tensors are F32 too,
# and so is ERNIE-4.5's [1, E] selection bias: llama.cpp's CPU add takes no F16 or block operand).
_F32_ROLES = frozenset({Role.FFN_GATE_INP, Role.FFN_GATE_INP_SHEXP, Role.FFN_EXP_PROBS_B,
                        Role.SSM_CONV1D})
# Stored as vectors: the shared expert's gate is a [1, H] matrix in the checkpoint, {H} in llama.cpp
# (and ERNIE-4.5's selection bias [1, E], {E}).
_VECTOR_ROLES = frozenset({Role.FFN_GATE_INP_SHEXP, Role.FFN_EXP_PROBS_B})


@dataclass
class GGUFExport:
    """What one export wrote."""

    path: str
    type: str
    architecture: str
    num_experts: int
    tensors: int
    file_bytes: int
    wall_seconds: float = 0.0
    peak_rss_mb: float = 0.0
    imatrix: bool = False
    gptq: bool = False  # block codes rounded by GPTQ against each matrix's Hessian
    lossless: bool = False  # GPTQ/AWQ codes handed to Q4_1 without requantizing
    types: dict[str, str] = field(default_factory=dict)  # GGUF tensor name -> its block type


@dataclass(frozen=True)
class _KVBPart:
    """llama.cpp's absorbed MLA reads kv_b_proj [heads x (nope + v), rank] as two tensors:
    ``attn_k_b`` [heads, rank, nope] (each head's key rows, transposed) and ``attn_v_b``
    [heads, v, rank] (each head's value rows)."""

    value: bool
    heads: int
    nope: int
    fmt: PackedFormat | None = None  # kv_b is packed: dequantized first

    def split(self, kv_b: np.ndarray) -> np.ndarray:
        per_head = kv_b.reshape(self.heads, -1, kv_b.shape[-1])
        if self.value:
            return per_head[:, self.nope :]
        return per_head[:, : self.nope].transpose(0, 2, 1)

    def join(self, k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
        return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, v_b.shape[-1])


@dataclass(frozen=True)
class _Tensor:
    """One GGUF tensor and the checkpoint tensors it is made of."""

    name: str
    keys: tuple[str, ...]  # checkpoint keys; a stacked tensor has one per expert
    stacked: bool
    shape: tuple[int, ...]
    qtype: QType
    packed: PackedFormat | None = None  # GPTQ/AWQ codes handed to Q4_1 as they are
    rotary_heads: int = 0  # > 0: rows permuted from HF's rotary layout to llama.cpp's
    # latent attention: this tensor is kv_b's key part (transposed) or value part, see _KVBPart
    kv_b: _KVBPart | None = None
    conversion: Conversion | None = None  # values transformed as llama.cpp's converter does

    def declare(self, writer: gguf.GGUFWriter) -> None:
        if self.qtype in _PLAIN_NUMPY:
            dtype = np.dtype(_PLAIN_NUMPY[self.qtype])
            writer.add_tensor_info(self.name, self.shape, dtype, math.prod(self.shape) * dtype.itemsize,
                                   raw_dtype=self.qtype)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(self.shape, self.qtype)
            writer.add_tensor_info(self.name, byte_shape, np.dtype(np.uint8),
                                   math.prod(byte_shape), raw_dtype=self.qtype)

    def read(self, reader: CheckpointReader) -> np.ndarray:
        """The source weights in fp32 (experts stacked on a new first axis)."""
        if self.kv_b is not None:
            return np.ascontiguousarray(self.kv_b.split(_weight(reader, self.keys[0],
                                                                self.kv_b.fmt)))
        if not self.stacked:
            data = reader.get(self.keys[0]).float().numpy().reshape(self.shape)
            if self.conversion is not None:
                data = self.conversion.apply(data)
            return _to_llama_rotary(data, self.rotary_heads) if self.rotary_heads else data
        out = np.empty(self.shape, dtype=np.float32)
        for e, key in enumerate(self.keys):
            out[e] = reader.get(key).float().numpy()
        return out

    def encode(self, reader: CheckpointReader, importance: ImportanceMatrix | None,
               gptq: bool = False, gptq_scales: str = "imatrix") -> np.ndarray:
        """The tensor's data as the file stores it (blocks as uint8, plain types as numbers).
        ``gptq`` rounds each matrix that has a Hessian by GPTQ into its fitted blocks; a matrix
        without one (an expert no calibration token reached) keeps the weighted fit."""
        if self.packed is not None:
            blocks = np.stack([_handoff_q4_1(reader, key, self.packed) for key in self.keys])
            if self.rotary_heads:  # rows move whole: a block lies within one row
                blocks = _to_llama_rotary(blocks[0], self.rotary_heads)[None]
            if self.conversion is not None:
                try:
                    blocks = self.conversion.permute_blocks(blocks[0], self.shape[-1],
                                                            HANDOFF_GROUP, self.keys[0])[None]
                except ValueError as err:
                    raise ExportError(f"{reader.path}: {err}") from None
            return blocks.reshape(gguf.quant_shape_to_byte_shape(self.shape, self.qtype))
        weights = self.read(reader)
        if importance is None or self.qtype not in IMPORTANCE_WEIGHTED:
            return quantize(weights, self.qtype)
        rows = self.importance(importance)
        hessians: list[np.ndarray | None] = [None] * len(self.keys)
        if gptq and self.qtype in GPTQ_TYPES:
            hessians = [importance.hessian(key) for key in self.keys]

        def one(w: np.ndarray, imp: np.ndarray | None, h: np.ndarray | None) -> np.ndarray:
            if h is None:
                return quantize(w, self.qtype, imp)
            return gptq_quantize(w.reshape(-1, w.shape[-1]), self.qtype, h,
                                 scales=gptq_scales)[0].reshape(
                *w.shape[:-1], -1)

        if not self.stacked:
            return one(weights, rows[0], hessians[0])
        return np.stack([one(w, imp, h)
                         for w, imp, h in zip(weights, rows, hessians, strict=True)])

    def importance(self, importance: ImportanceMatrix) -> list[np.ndarray | None]:
        """The importance of this tensor's input columns, one vector per matrix (per expert of a
        stacked tensor): llama.cpp's imatrix entry for the tensor's GGUF name. Rows permuted to
        llama.cpp's rotary layout keep their columns, so their importance is unchanged."""
        if self.kv_b is not None:  # k_b's columns are not kv_b's; v_b's rows are whole rows
            return [importance.get(self.keys[0]) if self.kv_b.value else None]
        return [importance.get(key) for key in self.keys]


def export_gguf(model_dir: str | Path, out: str | Path, gguf_type: str = "f16", *,
                importance: ImportanceMatrix | None = None, gptq: bool = False,
                gptq_scales: str = "imatrix", show_progress: bool = True) -> GGUFExport:
    """Write the checkpoint in ``model_dir`` to the GGUF file ``out`` (which must not exist)
    with its weight matrices in ``gguf_type``; norms and routers stay F32.

    ``importance`` (from ``compute_importance`` on the same model) weights the rounding of the
    K-quants and Q4_0/Q4_1/Q5_0 as llama.cpp's ``--imatrix`` does. A GPTQ or AWQ artifact with
    4-bit codes in groups of 32 exports to ``q4_1`` without requantizing: its codes and scales
    become the Q4_1 blocks, and its 16-bit embeddings and head take the types llama.cpp's own
    Q4_1 gives them (``tensor_type``: the head Q6_K, untied embeddings Q4_1).

    ``gptq`` (with an ``importance`` collected with ``hessians=True``) keeps the weighted fit's
    block scales and rounds the values by GPTQ against each matrix's full Hessian
    (``block_gptq``) for Q4_0, Q4_1, Q5_0, Q3_K, Q4_K and Q6_K tensors; ``gptq_scales="plain"``
    takes the block scales from the plain fit instead."""
    model_dir, out, gguf_type = Path(model_dir), Path(out), gguf_type.lower()
    gtype = _gguf_type(gguf_type)
    config = load_config(model_dir, dequantized=True)  # MXFP4 experts: read dequantized
    if getattr(config, "layer_num_experts", None):
        raise ExportError(f"{model_dir}: its layers keep different numbers of experts (a 'damage' "
                          "budget prune); GGUF holds one expert count per model")
    adapter = get_adapter(config)
    arch = _architecture(adapter, config, model_dir)
    if gptq and (importance is None or importance.hessians is None):
        raise ExportError("GPTQ rounding needs an importance matrix collected with its Hessians "
                          "(compute_importance(..., hessians=True))")
    fmt = _handoff_format(packed_format(config, model_dir), model_dir, gguf_type, importance)
    if fmt is not None:
        gtype = HANDOFF_TYPE
    if out.exists():
        raise ExportError(f"{out} already exists; choose a new output file or remove it")
    reader = CheckpointReader(model_dir)
    reader.check_against_config(config)
    reader = adapter.per_expert_reader(reader)  # gpt-oss's fused experts, one at a time
    plan = _plan(reader, adapter, config, arch, gtype, fmt, imatrix=importance is not None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with measure() as usage:
            writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch.arch])
            try:
                _write_metadata(writer, model_dir, config, adapter, reader, gtype, fmt, arch)
                if importance is not None:
                    writer.add_array(gguf.Keys.IMatrix.DATASETS, [importance.dataset])
                    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, importance.windows)
                _write_tokenizer(writer, model_dir, int(config.vocab_size))
                for tensor in plan:
                    tensor.declare(writer)
                writer.write_header_to_file(tmp)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                for tensor in tqdm(plan, desc=f"GGUF {gguf_type}", disable=not show_progress):
                    writer.write_tensor_data(tensor.encode(reader, importance, gptq, gptq_scales))
                    reader.close()
            finally:
                writer.close()
        os.replace(tmp, out)
    except OSError as err:  # a full disk: named, and the partial file removed below
        raise storage_error(err, out) from err
    finally:
        reader.close()
        tmp.unlink(missing_ok=True)
    result = GGUFExport(path=str(out), type=gguf_type, architecture=gguf.MODEL_ARCH_NAMES[arch.arch],
                        num_experts=adapter.num_experts(config), tensors=len(plan),
                        file_bytes=out.stat().st_size, wall_seconds=usage.wall_seconds,
                        peak_rss_mb=usage.peak_rss_mb, imatrix=importance is not None, gptq=gptq,
                        lossless=fmt is not None,
                        types={t.name: t.qtype.name for t in plan})
    log.info("exported %s -> %s (%s, %d tensors, %.1f MB, %.1f s)", model_dir, out, gguf_type,
             len(plan), result.file_bytes / 1e6, result.wall_seconds)
    return result


def gguf_importance(model_dir: str | Path, importance: ImportanceMatrix
                    ) -> dict[str, list[np.ndarray | None]]:
    """``importance`` keyed as llama.cpp's imatrix keys it: every weight matrix's GGUF name, with
    one vector per matrix (per expert of ``ffn_*_exps``; None where no calibration token reached
    it). The export weights each tensor's rounding with exactly these vectors."""
    model_dir = Path(model_dir)
    config = load_config(model_dir, dequantized=True)  # MXFP4 experts: read dequantized
    adapter = get_adapter(config)
    reader = adapter.per_expert_reader(CheckpointReader(model_dir))
    try:
        plan = _plan(reader, adapter, config, _architecture(adapter, config, model_dir),
                     GGUF_TYPES["f32"], None)
    finally:
        reader.close()
    return {t.name: t.importance(importance) for t in plan if len(t.shape) > 1}


def dequantize_gguf(gguf_path: str | Path, model_dir: str | Path, out_dir: str | Path) -> Path:
    """The weights of a GGUF file exported from the plain checkpoint ``model_dir``, dequantized
    into a plain checkpoint at ``out_dir`` (config and tokenizer copied): thresher's evaluation
    of it is the evaluation of the very weights llama.cpp runs."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = load_config(model_dir, dequantized=True)  # MXFP4 experts: read dequantized
    adapter = get_adapter(config)
    reader = adapter.per_expert_reader(CheckpointReader(model_dir))
    plan = _plan(reader, adapter, config, _architecture(adapter, config, model_dir),
                 GGUF_TYPES["f32"], None)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    if (missing := sorted({t.name for t in plan} - set(tensors))):
        raise ExportError(f"{gguf_path} lacks {missing[:4]}; was it exported from {model_dir}?")
    writer = CheckpointWriter(out_dir)
    key_parts: dict[str, np.ndarray] = {}  # latent attention's attn_k_b, until its attn_v_b
    layer: dict[str, torch.Tensor] = {}  # one block's tensors, fused back where the family fuses
    for n, t in enumerate(plan):
        data = gguf.quants.dequantize(tensors[t.name].data, tensors[t.name].tensor_type)
        if t.kv_b is not None and not t.kv_b.value:
            key_parts[t.keys[0]] = data.reshape(t.shape)
        elif t.kv_b is not None:
            joined = t.kv_b.join(key_parts.pop(t.keys[0]), data.reshape(t.shape))
            layer[t.keys[0]] = torch.from_numpy(joined.copy())
        else:
            if t.rotary_heads:
                data = _from_llama_rotary(data.reshape(t.shape), t.rotary_heads)
            if t.conversion is not None:
                data = t.conversion.invert(data.reshape(t.shape))
            parts = data.reshape(t.shape) if t.stacked else [data]
            layer.update({key: torch.from_numpy(np.array(part)).reshape(reader.shape(key))
                          for key, part in zip(t.keys, parts, strict=True)})
        if n + 1 == len(plan) or _block(plan[n + 1].name) != _block(t.name):
            writer.add(adapter.hub_experts(layer))
            layer = {}
    writer.close()
    reader.close()
    for f in model_dir.iterdir():
        if f.is_file() and ".safetensors" not in f.name and f.name != "thresher.json":
            shutil.copy2(f, out_dir / f.name)
    return out_dir


def _block(name: str) -> str:
    """The ``blk.N`` of a GGUF tensor name ("" outside the blocks)."""
    return name.split(".", 2)[1] if name.startswith("blk.") else ""


HANDOFF = "hand-off"  # GPTQ/AWQ codes become the Q4_1 blocks as they are
QUANTIZED = "quantized"  # a 16/32-bit checkpoint rounded into the type
REQUANTIZED = "requantized"  # a quantized checkpoint's dequantized weights rounded again


def gguf_route(fmt: PackedFormat | None, gguf_type: str, groups_in_order: bool = True) -> str:
    """How a checkpoint whose weights have the layout ``fmt`` (None: 16/32-bit) becomes a GGUF
    file of ``gguf_type``: ``HANDOFF`` where the type is what its codes already are (4-bit
    GPTQ/AWQ in groups of 32, in column order, to q4_1), else ``REQUANTIZED`` from its dequantized
    weights (a second rounding), or ``QUANTIZED`` from a plain checkpoint."""
    if fmt is None:
        return QUANTIZED
    if (fmt.format.integer_grid and fmt.bits == 4 and fmt.group_size == HANDOFF_GROUP
            and not fmt.mixed and groups_in_order and gguf_type.lower() == "q4_1"):
        return HANDOFF
    return REQUANTIZED


def check_gguf_architecture(config, where: str) -> None:
    """Refuse, from the config alone, a model llama.cpp's graphs would compute differently or
    cannot build (the checks ``export_gguf`` makes before it reads a weight)."""
    if getattr(config, "layer_num_experts", None):
        raise ExportError(f"{where}: its layers keep different numbers of experts (a 'damage' "
                          "budget prune); GGUF holds one expert count per model")
    _architecture(get_adapter(config), config, Path(where))


def check_gguf_widths(gguf_type: str, widths: dict[str, int]) -> None:
    """Refuse a type whose blocks some weight matrix's rows cannot hold: ``widths`` maps each
    matrix to its row width (inputs). K-quant rows that are not whole super-blocks fall back as
    llama.cpp's quantizer does, so only the fallback's block must divide them."""
    qtype = _gguf_type(gguf_type.lower()).default
    if qtype in _PLAIN_NUMPY or qtype == QType.BF16:
        return
    # Every other type ``tensor_type`` picks has, after the fallback, blocks of at most 32 values,
    # so the base type's (fallen back) block is the one that can fail to divide a row.
    for name, cols in widths.items():
        kind = _K_FALLBACK.get(qtype, qtype) if cols % QK_K else qtype
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if cols % block:
            raise ExportError(f"GGUF {gguf_type}: {name} has rows of {cols} values, not a "
                              f"multiple of the {kind.name} block of {block}; choose f16 "
                              "or bf16")


def _handoff_format(fmt: PackedFormat | None, model_dir: Path, gguf_type: str,
                    importance: ImportanceMatrix | None) -> PackedFormat | None:
    """The packed format of an artifact that exports to Q4_1 as it is; refuses the others."""
    if fmt is None:
        return None
    what = f"{model_dir} holds {fmt.kind} {fmt.bits}-bit weights"
    if not fmt.format.integer_grid or fmt.bits != 4:
        raise ExportError(f"{what}; only 4-bit GPTQ and AWQ artifacts export to GGUF (to q4_1, "
                          "without requantizing), so export the 16-bit model with a GGUF --type")
    if fmt.group_size != HANDOFF_GROUP:
        raise ExportError(
            f"{what} in groups of {fmt.group_size}; GGUF's Q4_1 blocks hold {HANDOFF_GROUP} "
            f"weights with one scale and minimum, so only group size {HANDOFF_GROUP} exports "
            "without requantizing: quantize with group_size: 32, or export the 16-bit model with "
            "a GGUF --type")
    if gguf_type != "q4_1":
        raise ExportError(f"{what}; a quantized artifact exports to --type q4_1 only (its codes "
                          f"and scales as they are), not {gguf_type}")
    if importance is not None:
        raise ExportError(f"{what}; an importance matrix applies when quantizing a 16-bit model, "
                          "and this artifact's codes are already chosen")
    return fmt


def _handoff_q4_1(reader: CheckpointReader, key: str, fmt: PackedFormat) -> np.ndarray:
    """Q4_1 blocks [N, K/32 * 20] of one packed [N, K] matrix: d = the group's scale, the codes
    as they are, m = -scale*zero (the one rounding: m is fp16)."""
    module = key.removesuffix(".weight")
    tensors = {name: reader.get(f"{module}.{name}") for name in fmt.format.tensors}
    qw = fmt.format.unpack(tensors, 4, HANDOFF_GROUP)
    rows, cols = qw.codes.shape
    if not torch.equal(qw.g_idx.long(), torch.arange(cols) // HANDOFF_GROUP):
        raise ExportError(f"{reader.path}: {module} has act-order groups (g_idx out of order); "
                          "Q4_1 blocks need input columns in groups of 32 in order")
    scales = qw.scales.numpy()
    mins = -(qw.scales * qw.zeros.float()).numpy()
    codes = qw.codes.numpy().reshape(rows, cols // 32, 2, 16)
    blocks = np.concatenate([
        scales.astype(np.float16).view(np.uint8).reshape(rows, -1, 2),
        mins.astype(np.float16).view(np.uint8).reshape(rows, -1, 2),
        (codes[:, :, 0] | (codes[:, :, 1] << 4)).astype(np.uint8)], axis=2)
    return blocks.reshape(rows, -1)


def _gguf_type(gguf_type: str) -> GGUFType:
    try:
        return GGUF_TYPES[gguf_type]
    except KeyError:
        raise ExportError(f"GGUF type {gguf_type!r} is not supported; choose one of "
                          + ", ".join(GGUF_TYPES)) from None


def _architecture(adapter: Adapter, config, model_dir: Path) -> GGUFArchitecture:
    arch = GGUF_ARCHITECTURES.get(adapter.model_type)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{model_dir}: model type {adapter.model_type!r} has no GGUF export yet; exportable: "
            + ", ".join(sorted(GGUF_ARCHITECTURES)))
    if (adapter.is_moe and not arch.router_metadata
            and arch.renormalizes_top_k != adapter.forward_renormalizes(config)):
        raise ExportError(
            f"{model_dir}: llama.cpp's {gguf.MODEL_ARCH_NAMES[arch.arch]} graph "
            + ("renormalizes" if arch.renormalizes_top_k else "does not renormalize")
            + " the top-k gate weights and this model's forward does not match; the GGUF would "
            "compute a different model")
    if arch.arch == gguf.MODEL_ARCH.OLMOE and config.num_key_value_heads != config.num_attention_heads:
        raise ExportError(f"{model_dir}: llama.cpp's olmoe graph normalizes k over all "
                          f"{config.hidden_size} channels, so it needs as many k/v heads as q heads "
                          f"({config.num_key_value_heads} vs {config.num_attention_heads})")
    if adapter.is_moe and adapter.moe_layer_step(config) > 1:
        raise ExportError(f"{model_dir}: an MoE layer every {adapter.moe_layer_step(config)} "
                          "layers, dense MLPs between: llama.cpp's graph honours "
                          "interleave_moe_layer_step, but its loader (llama-cpp-python 0.3.36) "
                          "reads experts in every layer after the leading dense ones and fails "
                          "on the first dense one, so no GGUF of this model loads")
    rope = getattr(config, "rope_parameters", None) or {}
    if arch.hybrid and adapter.full_attention_interval(config) is None:
        raise ExportError(f"{model_dir}: llama.cpp's {gguf.MODEL_ARCH_NAMES[arch.arch]} graph "
                          "takes a full-attention layer every N layers (the last of each N); "
                          f"layer_types {list(config.layer_types)} is not laid out so")
    if arch.hybrid and config.linear_key_head_dim != config.linear_value_head_dim:
        raise ExportError(f"{model_dir}: llama.cpp's {gguf.MODEL_ARCH_NAMES[arch.arch]} graph "
                          "takes one head width for the DeltaNet's keys and values "
                          f"({config.linear_key_head_dim} and {config.linear_value_head_dim} "
                          "here)")
    if adapter.attention_kind == "mla" and not getattr(config, "rope_interleave", True):
        raise ExportError(f"{model_dir}: llama.cpp's deepseek2 graph rotates adjacent channel "
                          "pairs (rope_interleave: true, as DeepSeek-V3 and Kimi-K2 ship); this "
                          "config rotates halves")
    if rope.get("rope_type", "default") not in arch.rope_types:
        raise ExportError(f"{model_dir}: rope type {rope['rope_type']!r} is not exported to GGUF "
                          f"for {adapter.model_type} yet; only {', '.join(arch.rope_types)}")
    return arch


def _plan(reader: CheckpointReader, adapter: Adapter, config, arch: GGUFArchitecture,
          gtype: GGUFType, fmt: PackedFormat | None, imatrix: bool = False) -> list[_Tensor]:
    """Every GGUF tensor in file order, with the checkpoint tensors it is built from. Fails if
    the architecture lacks a role or the checkpoint holds a tensor that nothing exports."""
    allowed = set(gguf.MODEL_TENSORS[arch.arch])
    n_layers = int(config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan: list[_Tensor] = []

    def matrix_type(role: Role, bid: int | None, cols: int) -> QType:
        if fmt is not None and role not in (Role.TOKEN_EMBD, Role.OUTPUT):
            return QType.F16
        return tensor_type(gtype, role, bid, n_layers, cols, tied=tied,
                           n_experts=adapter.num_experts(config) if adapter.is_moe else 0,
                           imatrix=imatrix)

    def add(role: Role, modules: list[str], bid: int | None = None, stacked: bool = False,
            suffix: str = "weight", gguf_suffix: str | None = None,
            shape: tuple[int, ...] | None = None, conversion: Conversion | None = None) -> None:
        if role not in allowed:
            raise ExportError(f"llama.cpp's {gguf.MODEL_ARCH_NAMES[arch.arch]} has no "
                              f"{role.name} tensor")
        keys = tuple(f"{m}.{suffix}" for m in modules)
        packed = fmt if (fmt is not None and keys[0] not in reader
                         and f"{modules[0]}.{fmt.format.marker}" in reader) else None
        first = _matrix_shape(reader, modules[0], packed) if packed else reader.shape(keys[0])
        first = shape or first  # a conv kernel [C, 1, K] stored as [C, K]
        shape = (len(keys), *first) if stacked else first
        if role in _VECTOR_ROLES:
            shape = (math.prod(shape),)
        if packed is not None:
            ttype = QType.Q4_1
        elif len(first) == 1 or role in _F32_ROLES:
            ttype = QType.F32
        else:
            ttype = matrix_type(role, bid, shape[-1])
        if ttype not in _PLAIN_NUMPY and shape[-1] % gguf.GGML_QUANT_SIZES[ttype][0]:
            raise ExportError(f"{reader.path}: {keys[0]} has rows of {shape[-1]} values, not a "
                              f"multiple of the {ttype.name} block; choose f16 or bf16")
        suffix_out = suffix if gguf_suffix is None else gguf_suffix
        name = gguf.TENSOR_NAMES[role].format(bid=bid) + (f".{suffix_out}" if suffix_out else "")
        heads = 0
        if arch.permute_qk and role in (Role.ATTN_Q, Role.ATTN_K):
            heads = int(config.num_attention_heads if role == Role.ATTN_Q
                        else config.num_key_value_heads)
        plan.append(_Tensor(name, keys, stacked, shape, ttype, packed, heads,
                            conversion=conversion))

    n_experts = adapter.num_experts(config)
    # zero-centered norms (Qwen3.5) multiply by 1 + weight; llama.cpp's graph by the weight
    norm = Conversion(offset=adapter.norm_weight_offset) if adapter.norm_weight_offset else None
    linear = set(adapter.linear_attention_layers(config))
    add(Role.TOKEN_EMBD, [adapter.disk_embeddings_key()])
    for i in range(config.num_hidden_layers):
        add(Role.ATTN_NORM, [adapter.disk_input_norm_key(i)], i, conversion=norm)
        if i in linear:
            plan_deltanet(add, adapter, config, i)
        elif adapter.attention_kind == "mla":
            _plan_latent_attention(plan, add, reader, adapter, config, fmt, i)
        else:
            for role, proj in ((Role.ATTN_Q, "q_proj"), (Role.ATTN_K, "k_proj"),
                               (Role.ATTN_V, "v_proj"), (Role.ATTN_OUT, "o_proj")):
                add(role, [adapter.disk_attention_key(i, proj)], i)
                if adapter.disk_attention_key(i, proj) + ".bias" in reader:
                    add(role, [adapter.disk_attention_key(i, proj)], i, suffix="bias")
            for role, name in ((Role.ATTN_Q_NORM, "q_norm"), (Role.ATTN_K_NORM, "k_norm")):
                if adapter.disk_attention_key(i, name) + ".weight" in reader:
                    add(role, [adapter.disk_attention_key(i, name)], i, conversion=norm)
            if adapter.disk_attention_key(i, "sinks") in reader:  # gpt-oss: one logit per head
                add(Role.ATTN_SINKS, [adapter.disk_attention_key(i, "sinks").rsplit(".", 1)[0]],
                    i, suffix="sinks", gguf_suffix="weight")
        add(arch.post_attention_norm, [adapter.disk_post_attention_norm_key(i)], i,
            conversion=norm)
        if not adapter.is_moe or i < adapter.leading_dense_layers(config):
            for role, proj in ((Role.FFN_GATE, "gate_proj"), (Role.FFN_UP, "up_proj"),
                               (Role.FFN_DOWN, "down_proj")):
                add(role, [adapter.disk_dense_mlp_key(i, proj)], i)
            continue
        if adapter.disk_router_key(i) + ".weight" not in reader:
            raise ExportError(f"{reader.path}: layer {i} has no router; llama.cpp's "
                              f"{gguf.MODEL_ARCH_NAMES[arch.arch]} expects experts in every layer")
        add(Role.FFN_GATE_INP, [adapter.disk_router_key(i)], i)
        if adapter.disk_router_key(i) + ".bias" in reader:  # gpt-oss
            add(Role.FFN_GATE_INP, [adapter.disk_router_key(i)], i, suffix="bias")
        correction = adapter.disk_router_correction_key(i)
        if correction is not None and correction in reader:  # selection-only bias, F32
            module, name = correction.rsplit(".", 1)
            add(Role.FFN_EXP_PROBS_B, [module], i, suffix=name, gguf_suffix="bias")
        for role, proj in ((Role.FFN_GATE_EXP, "gate"), (Role.FFN_UP_EXP, "up"),
                           (Role.FFN_DOWN_EXP, "down")):
            add(role, [adapter.disk_expert_key(i, e, proj) for e in range(n_experts)], i,
                stacked=True)
            if adapter.disk_expert_key(i, 0, proj) + ".bias" in reader:  # gpt-oss, F32
                add(role, [adapter.disk_expert_key(i, e, proj) for e in range(n_experts)], i,
                    stacked=True, suffix="bias")
        if adapter.disk_shared_expert_gate_key(i) + ".weight" in reader:
            add(Role.FFN_GATE_INP_SHEXP, [adapter.disk_shared_expert_gate_key(i)], i)
        shared = adapter.disk_shared_expert_key(i, "gate_proj")
        if shared + ".weight" in reader or shared + ".qweight" in reader:
            for role, proj in ((Role.FFN_GATE_SHEXP, "gate_proj"), (Role.FFN_UP_SHEXP, "up_proj"),
                               (Role.FFN_DOWN_SHEXP, "down_proj")):
                add(role, [adapter.disk_shared_expert_key(i, proj)], i)
    add(Role.OUTPUT_NORM, [adapter.disk_final_norm_key()], conversion=norm)
    head = adapter.disk_lm_head_key() + ".weight"
    if not tied:
        add(Role.OUTPUT, [adapter.disk_lm_head_key()])

    used = {k for t in plan for k in t.keys} | ({head} if tied else set())
    for t in plan:
        fmt = t.packed or (t.kv_b.fmt if t.kv_b else None)
        if fmt is not None:
            used |= {f"{k.removesuffix('.weight')}.{part}" for k in t.keys
                     for part in fmt.format.tensors}
    unused = sorted(set(reader.tensor_names()) - used)
    if unused:
        raise ExportError(f"{reader.path}: tensors with no GGUF counterpart: {unused[:4]}"
                          + (f" and {len(unused) - 4} more" if len(unused) > 4 else ""))
    return plan


def _plan_latent_attention(plan: list[_Tensor], add, reader: CheckpointReader, adapter: Adapter,
                           config, fmt: PackedFormat | None, i: int) -> None:
    """Layer ``i``'s MLA tensors: q_a (with its norm) and q_b, or q; kv_a with its norm; kv_b as
    ``attn_k_b``/``attn_v_b``, in F32 whatever the file type: llama-cpp-python 0.3.36's CPU
    backend cannot schedule its absorbed-MLA matmuls on F16 ones (GGML_ASSERT in the graph
    split), a transposed k_b cannot keep a packed kv_b's blocks, and the pair is about 1 % of a
    4-bit DeepSeek-V3 (61 x 128 heads x 512 x 256 x 4 bytes = 4.1 GB); o."""
    def key(name: str) -> str:
        return adapter.disk_attention_key(i, name)

    if any(key("q_a_proj") + part in reader for part in (".weight", ".qweight")):
        add(Role.ATTN_Q_A, [key("q_a_proj")], i)
        add(Role.ATTN_Q_A_NORM, [key("q_a_layernorm")], i)
        add(Role.ATTN_Q_B, [key("q_b_proj")], i)
    else:
        add(Role.ATTN_Q, [key("q_proj")], i)
    add(Role.ATTN_KV_A_MQA, [key("kv_a_proj_with_mqa")], i)
    add(Role.ATTN_KV_A_NORM, [key("kv_a_layernorm")], i)
    heads, nope = int(config.num_attention_heads), int(config.qk_nope_head_dim)
    rank, v_dim = int(config.kv_lora_rank), int(config.v_head_dim)
    packed = fmt if key("kv_b_proj") + ".weight" not in reader else None
    for role, value, shape in ((Role.ATTN_K_B, False, (heads, rank, nope)),
                               (Role.ATTN_V_B, True, (heads, v_dim, rank))):
        name = f"{gguf.TENSOR_NAMES[role].format(bid=i)}.weight"
        plan.append(_Tensor(name, (key("kv_b_proj") + ".weight",), False, shape, QType.F32,
                            kv_b=_KVBPart(value, heads, nope, packed)))
    add(Role.ATTN_OUT, [key("o_proj")], i)


def _weight(reader: CheckpointReader, key: str, fmt: PackedFormat | None) -> np.ndarray:
    """A weight matrix in fp32, dequantized from its GPTQ/AWQ tensors when packed."""
    if fmt is None:
        return reader.get(key).float().numpy()
    module = key.removesuffix(".weight")
    tensors = {name: reader.get(f"{module}.{name}") for name in fmt.format.tensors
               if f"{module}.{name}" in reader}
    return fmt.format.dequantize(tensors, fmt.bits, fmt.group_size).float().numpy()


def _to_llama_rotary(rows: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows from HF's rotary layout (each head's first half pairs with its second half) to
    llama.cpp's (adjacent rows pair), as llama.cpp's converter permutes them."""
    return (rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def _from_llama_rotary(rows: np.ndarray, heads: int) -> np.ndarray:
    return (rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def tensor_type(gtype: GGUFType, role: Role, layer: int | None, n_layers: int, cols: int, *,
                tied: bool, n_experts: int, imatrix: bool) -> QType:
    """llama.cpp's type for one weight matrix of a ``gtype`` file, as its quantizer chooses it
    (llama_tensor_get_type) for the file types thresher writes: the output head, and the
    embeddings when the head is tied to them, at Q6_K (Q8_0 in a Q8_0 file), untied embeddings at
    the base type; the K-quant mixes' attn_v, attn_output and ffn_down; attn_v and attn_k at Q8_0
    in a model of exactly 8 experts (Mixtral); with an importance matrix, the first eighth of
    ffn_down at Q4_1/Q5_1 in Q4_0/Q5_0 files; then the fallback for rows that are not whole
    super-blocks."""
    base, ft = gtype.default, gtype.file_type
    if ft in _UNQUANTIZED_FILES:
        return base
    qtype = base
    if role == Role.OUTPUT or (tied and role == Role.TOKEN_EMBD):
        block = gguf.GGML_QUANT_SIZES[base][0]
        qtype = QType.Q8_0 if base == QType.Q8_0 or cols % block else QType.Q6_K
    elif role == Role.ATTN_V:
        if ft == _FT.MOSTLY_Q3_K_M:
            qtype = QType.Q5_K if layer < 2 else QType.Q4_K
        elif ft == _FT.MOSTLY_Q4_K_M and _more_bits(layer, n_layers):
            qtype = QType.Q6_K
        elif ft == _FT.MOSTLY_Q4_K_S and layer < 4:
            qtype = QType.Q5_K
        if n_experts == 8:
            qtype = QType.Q8_0
    elif role == Role.ATTN_K and n_experts == 8:
        qtype = QType.Q8_0
    elif role in _FFN_DOWN_ROLES:
        if ft == _FT.MOSTLY_Q3_K_M:
            qtype = QType.Q5_K if layer < n_layers // 16 else QType.Q4_K
        elif ft == _FT.MOSTLY_Q4_K_M and _more_bits(layer, n_layers):
            qtype = QType.Q6_K
        elif ft == _FT.MOSTLY_Q4_K_S and layer < n_layers // 8:
            qtype = QType.Q5_K
        elif imatrix and layer < n_layers // 8 and ft in (_FT.MOSTLY_Q4_0, _FT.MOSTLY_Q5_0):
            qtype = QType.Q4_1 if ft == _FT.MOSTLY_Q4_0 else QType.Q5_1
    elif role == Role.ATTN_OUT:
        if n_experts == 8 and ft in _K_MIXES:
            qtype = QType.Q5_K
        elif n_experts != 8 and ft == _FT.MOSTLY_Q3_K_M:
            qtype = QType.Q4_K
    if qtype in _K_FALLBACK and cols % QK_K:
        qtype = _K_FALLBACK[qtype]
    return qtype


def _more_bits(layer: int | None, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one
    between them keep attn_v and ffn_down at Q6_K in Q4_K_M."""
    return layer is not None and (layer < n_layers // 8 or layer >= 7 * n_layers // 8
                                  or (layer - n_layers // 8) % 3 == 2)


def _matrix_shape(reader: CheckpointReader, module: str, fmt: PackedFormat | None
                  ) -> tuple[int, ...]:
    """[out, in] of a weight matrix, plain or packed (as its format reads its tensors' shapes)."""
    if fmt is None:
        return reader.shape(f"{module}.weight")
    shapes = {n: reader.shape(f"{module}.{n}") for n in fmt.format.tensors
              if f"{module}.{n}" in reader}
    return fmt.format.matrix_shape(shapes, fmt.bits)


def _write_metadata(writer: gguf.GGUFWriter, model_dir: Path, config, adapter: Adapter,
                    reader: CheckpointReader, gtype: GGUFType, fmt: PackedFormat | None,
                    arch: GGUFArchitecture) -> None:
    """The hyperparameters llama.cpp reads; sizes come from the tensors where the config names
    them differently per family."""
    heads = int(config.num_attention_heads)

    def shape(module: str) -> tuple[int, ...]:
        packed = fmt if f"{module}.weight" not in reader else None
        return _matrix_shape(reader, module, packed)

    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name(model_dir.name)
    writer.add_file_type(gtype.file_type)
    if gtype.file_type not in _UNQUANTIZED_FILES:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    dense_ffn = getattr(config, "intermediate_size", None)  # Qwen3.5-MoE has no dense MLP
    if isinstance(dense_ffn, int):
        writer.add_feed_forward_length(dense_ffn)
    writer.add_head_count(heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    if adapter.attention_kind == "mla":
        _write_latent_attention_metadata(writer, config, rope)
    else:
        full = next(i for i in range(int(config.num_hidden_layers))
                    if i not in set(adapter.linear_attention_layers(config)))
        head_dim = getattr(config, "head_dim", None) or (
            shape(adapter.disk_attention_key(full, "q_proj"))[0] // heads)
        writer.add_head_count_kv(int(config.num_key_value_heads))
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
        rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        if rotary_dim != head_dim:  # partial rotary (GLM-4.5): the first channels of each head
            writer.add_rope_dimension_count(rotary_dim)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    windows = {adapter.sliding_window(config, i) for i in range(int(config.num_hidden_layers))}
    if windows - {None}:  # gpt-oss: llama.cpp alternates sliding and full layers, sliding first
        writer.add_sliding_window(max(windows - {None}))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if arch.hybrid:
        write_deltanet_metadata(writer, config, adapter)
    if adapter.is_moe:
        moe = adapter.leading_dense_layers(config)  # the first MoE layer
        expert_ffn = shape(adapter.disk_expert_key(moe, 0, "gate"))[0]
        writer.add_expert_feed_forward_length(int(expert_ffn))
        writer.add_expert_count(adapter.num_experts(config))
        writer.add_expert_used_count(adapter.top_k(config))
        shared = adapter.disk_shared_expert_key(moe, "gate_proj")
        shared_ffn = 0
        if shared + ".weight" in reader or shared + ".qweight" in reader:
            shared_ffn = int(shape(shared)[0])
            writer.add_expert_shared_feed_forward_length(shared_ffn)
        if arch.router_metadata:
            _write_router_metadata(writer, config, adapter, shared_ffn // expert_ffn)
        if arch.moe_layout_metadata:
            writer.add_leading_dense_block_count(moe)
            writer.add_interleave_moe_layer_step(adapter.moe_layer_step(config))
            writer.add_expert_shared_count(shared_ffn // expert_ffn)


def _write_latent_attention_metadata(writer: gguf.GGUFWriter, config, rope: dict) -> None:
    """deepseek2's MLA keys, as llama.cpp's converter writes them: attention runs as one kv
    head whose key is the latent plus the rotary key and whose value is the latent
    (key/value_length), over heads of qk_nope + qk_rope keys and v values (the ``_mla`` lengths);
    yarn's mscale (0.1 x mscale_all_dim as the log multiplier) and its betas."""
    rank, rope_dim = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    if config.q_lora_rank:
        writer.add_q_lora_rank(int(config.q_lora_rank))
    writer.add_kv_lora_rank(rank)
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rope_dim)
    writer.add_value_length(rank)
    writer.add_key_length_mla(int(config.qk_nope_head_dim) + rope_dim)
    writer.add_value_length_mla(int(config.v_head_dim))
    writer.add_rope_dimension_count(rope_dim)
    if rope.get("rope_type") == "yarn":  # type, factor and context: _write_metadata
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim", 0) or 0))
        # llama.cpp's defaults are DeepSeek-V3's 32 and 1; Kimi-K2 ships 1 and 1
        writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32)))
        writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1)))


def _write_router_metadata(writer: gguf.GGUFWriter, config, adapter: Adapter,
                           shared_experts: int) -> None:
    """The keys llama.cpp's glm4moe and deepseek2 graphs route by: sigmoid gating (the ``exp_probs_b`` bias
    selects), top-k normalization and scale, expert groups, the dense leading layers, and no
    multi-token-prediction layers (thresher does not carry them)."""
    rule = adapter.rule(config)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_norm(rule.renormalize)
    writer.add_expert_weights_scale(rule.scaling)
    writer.add_expert_shared_count(shared_experts)
    writer.add_leading_dense_block_count(adapter.leading_dense_layers(config))
    writer.add_nextn_predict_layers(0)
    if rule.n_group > 1:
        writer.add_expert_group_count(rule.n_group)
        writer.add_expert_group_used_count(rule.topk_group)


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with GPT-2's pre-tokenizer as llama.cpp's ``gpt2`` model:
    tokens padded to the model's vocabulary, token types, merges, special ids."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_dir}: no tokenizer.json; GGUF files carry their tokenizer")
    check_tokenizer_files(model_dir)
    tok = json.loads(path.read_text())
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    pre_name = _pre_tokenizer_name(pre)
    if model.get("type") != "BPE" or model.get("byte_fallback") or pre_name is None:
        raise ExportError(
            f"{path}: GGUF export takes byte-level BPE tokenizers with GPT-2's or Qwen2's "
            f"pre-tokenizer so far; this one is {model.get('type')} with pre-tokenizer "
            f"{json.dumps(pre)[:200]}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    entries = [(text, i, gguf.TokenType.NORMAL) for text, i in model["vocab"].items()]
    entries += [(a["content"], a["id"], gguf.TokenType.CONTROL if a.get("special")
                 else gguf.TokenType.USER_DEFINED) for a in tok.get("added_tokens", [])]
    for text, i, ttype in entries:
        if i >= vocab_size:
            raise ExportError(f"{path}: token {text!r} has id {i}, beyond the model's "
                              f"vocabulary of {vocab_size}")
        tokens[i], types[i] = text, ttype
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token:  # the tokenizer's template adds no BOS token
        writer.add_add_bos_token(False)


def _pre_tokenizer_name(pre: dict) -> str | None:
    """llama.cpp's name for a tokenizer.json ``pre_tokenizer``; None if it is not one we know.

    llama.cpp does not read the regex from the file: it picks its own by this name, so only
    pre-tokenizers known to be identical are mapped."""
    if pre.get("type") == "ByteLevel":  # with use_regex, the ByteLevel step applies GPT-2's regex
        plain = pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
        return "gpt-2" if plain else None
    steps = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") == "Split" and split.get("behavior") == "Isolated"
            and not split.get("invert", False)
            and (split.get("pattern") or {}).get("Regex") == QWEN2_PRE_TOKENIZER_REGEX
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space", False)):
        return "qwen2"
    return None
