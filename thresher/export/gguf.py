"""GGUF export: a plain 16/32-bit thresher checkpoint as one GGUF file for llama.cpp and Ollama.

Families: Qwen3-MoE (llama.cpp's ``qwen3moe``), Qwen2-MoE (``qwen2moe``, with its shared expert)
and the dense Qwen3 and Qwen2 (``qwen3``, ``qwen2``).

GGUF names tensors by role (``blk.3.attn_q.weight``) and stacks each layer's experts into one 3-D
tensor per projection (``blk.3.ffn_gate_exps.weight``, [E, I, H] in row-major order); its
metadata carries the hyperparameters llama.cpp builds its graph from and the whole tokenizer. The
``gguf`` package (llama.cpp's own Python writer) supplies the container, the architecture and
tensor names, the metadata keys and the block quantizers (Q8_0, Q4_0, Q4_1).

The file is written in two passes so that memory stays near one stacked expert tensor: the tensor
table is declared from the checkpoint's headers, then each tensor is read, converted and written
in turn. A REAP-pruned model exports like any other; its config simply has fewer experts.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tqdm.auto import tqdm

from thresher.errors import ExportError, UnsupportedArchitectureError
from thresher.formats.config import packed_format
from thresher.models.adapters import Adapter, get_adapter
from thresher.models.checkpoint import CheckpointReader
from thresher.models.layerwise import load_config
from thresher.resources import measure

log = logging.getLogger(__name__)

QType = gguf.GGMLQuantizationType
Role = gguf.MODEL_TENSOR

GGUF_TYPES: dict[str, QType] = {
    "f32": QType.F32, "f16": QType.F16, "bf16": QType.BF16,
    "q8_0": QType.Q8_0, "q4_0": QType.Q4_0, "q4_1": QType.Q4_1,
}
_FILE_TYPES: dict[QType, gguf.LlamaFileType] = {
    QType.F32: gguf.LlamaFileType.ALL_F32, QType.F16: gguf.LlamaFileType.MOSTLY_F16,
    QType.BF16: gguf.LlamaFileType.MOSTLY_BF16, QType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    QType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, QType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
}
_PLAIN_NUMPY = {QType.F32: np.float32, QType.F16: np.float16}  # stored as numpy arrays, not bytes


@dataclass(frozen=True)
class GGUFArchitecture:
    """What llama.cpp's graph for one thresher family assumes about the checkpoint."""

    arch: gguf.MODEL_ARCH
    renormalizes_top_k: bool | None = None  # MoE: llama.cpp renormalizes the top-k gate weights


# Keyed by the adapter's model_type. Only families whose weights llama.cpp takes as they are on
# disk are listed; llama and mixtral need their q/k rows permuted for llama.cpp's rotary layout.
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "qwen3_moe": GGUFArchitecture(gguf.MODEL_ARCH.QWEN3MOE, renormalizes_top_k=True),
    "qwen2_moe": GGUFArchitecture(gguf.MODEL_ARCH.QWEN2MOE, renormalizes_top_k=False),
    "qwen3": GGUFArchitecture(gguf.MODEL_ARCH.QWEN3),
    "qwen2": GGUFArchitecture(gguf.MODEL_ARCH.QWEN2),
}

# Qwen2's pre-tokenizer regex (Qwen2, Qwen2.5, Qwen3 and their MoEs), as tokenizer.json spells it.
QWEN2_PRE_TOKENIZER_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Kept in F32 whatever the file type, as llama.cpp's converter does (1-D tensors are F32 too).
_F32_ROLES = frozenset({Role.FFN_GATE_INP, Role.FFN_GATE_INP_SHEXP})
# Stored as vectors: the shared expert's gate is a [1, H] matrix in the checkpoint, {H} in llama.cpp.
_VECTOR_ROLES = frozenset({Role.FFN_GATE_INP_SHEXP})


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


@dataclass(frozen=True)
class _Tensor:
    """One GGUF tensor and the checkpoint tensors it is made of."""

    name: str
    keys: tuple[str, ...]  # checkpoint keys; a stacked tensor has one per expert
    stacked: bool
    shape: tuple[int, ...]
    qtype: QType

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
        if not self.stacked:
            return reader.get(self.keys[0]).float().numpy().reshape(self.shape)
        out = np.empty(self.shape, dtype=np.float32)
        for e, key in enumerate(self.keys):
            out[e] = reader.get(key).float().numpy()
        return out


def export_gguf(model_dir: str | Path, out: str | Path, gguf_type: str = "f16", *,
                show_progress: bool = True) -> GGUFExport:
    """Write the plain checkpoint in ``model_dir`` to the GGUF file ``out`` (which must not
    exist) with its weight matrices in ``gguf_type``; norms and routers stay F32."""
    model_dir, out, gguf_type = Path(model_dir), Path(out), gguf_type.lower()
    qtype = _qtype(gguf_type)
    config = load_config(model_dir)
    adapter = get_adapter(config)
    arch = _architecture(adapter, config, model_dir)
    if (fmt := packed_format(config, model_dir)) is not None:
        raise ExportError(
            f"{model_dir} holds {fmt.kind} {fmt.bits}-bit weights; GGUF export takes plain "
            "16/32-bit checkpoints for now (the base or a pruned model), so export the model "
            "before quantizing it, with a GGUF --type instead")
    if out.exists():
        raise ExportError(f"{out} already exists; choose a new output file or remove it")
    reader = CheckpointReader(model_dir)
    plan = _plan(reader, adapter, config, arch, qtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with measure() as usage:
            writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch.arch])
            try:
                _write_metadata(writer, model_dir, config, adapter, reader, qtype)
                _write_tokenizer(writer, model_dir, int(config.vocab_size))
                for tensor in plan:
                    tensor.declare(writer)
                writer.write_header_to_file(tmp)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                for tensor in tqdm(plan, desc=f"GGUF {gguf_type}", disable=not show_progress):
                    writer.write_tensor_data(gguf.quants.quantize(tensor.read(reader),
                                                                  tensor.qtype))
                    reader.close()
            finally:
                writer.close()
        os.replace(tmp, out)
    finally:
        reader.close()
        tmp.unlink(missing_ok=True)
    result = GGUFExport(path=str(out), type=gguf_type, architecture=gguf.MODEL_ARCH_NAMES[arch.arch],
                        num_experts=adapter.num_experts(config), tensors=len(plan),
                        file_bytes=out.stat().st_size, wall_seconds=usage.wall_seconds,
                        peak_rss_mb=usage.peak_rss_mb)
    log.info("exported %s -> %s (%s, %d tensors, %.1f MB, %.1f s)", model_dir, out, gguf_type,
             len(plan), result.file_bytes / 1e6, result.wall_seconds)
    return result


def _qtype(gguf_type: str) -> QType:
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
    if adapter.is_moe and arch.renormalizes_top_k != adapter.forward_renormalizes(config):
        raise ExportError(
            f"{model_dir}: llama.cpp's {gguf.MODEL_ARCH_NAMES[arch.arch]} graph "
            + ("renormalizes" if arch.renormalizes_top_k else "does not renormalize")
            + " the top-k gate weights and this model's forward does not match; the GGUF would "
            "compute a different model")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"{model_dir}: rope type {rope['rope_type']!r} is not exported to GGUF "
                          "yet; only the default rotary embedding is")
    return arch


def _plan(reader: CheckpointReader, adapter: Adapter, config, arch: GGUFArchitecture,
          qtype: QType) -> list[_Tensor]:
    """Every GGUF tensor in file order, with the checkpoint tensors it is built from. Fails if
    the architecture lacks a role or the checkpoint holds a tensor that nothing exports."""
    allowed = set(gguf.MODEL_TENSORS[arch.arch])
    plan: list[_Tensor] = []

    def add(role: Role, modules: list[str], bid: int | None = None, stacked: bool = False,
            suffix: str = "weight") -> None:
        if role not in allowed:
            raise ExportError(f"llama.cpp's {gguf.MODEL_ARCH_NAMES[arch.arch]} has no "
                              f"{role.name} tensor")
        keys = tuple(f"{m}.{suffix}" for m in modules)
        first = reader.shape(keys[0])
        shape = (len(keys), *first) if stacked else first
        if role in _VECTOR_ROLES:
            shape = (math.prod(shape),)
        ttype = QType.F32 if len(first) == 1 or role in _F32_ROLES else qtype
        if ttype not in _PLAIN_NUMPY and shape[-1] % gguf.GGML_QUANT_SIZES[ttype][0]:
            raise ExportError(f"{reader.path}: {keys[0]} has rows of {shape[-1]} values, not a "
                              f"multiple of the {ttype.name} block; choose f16 or bf16")
        name = f"{gguf.TENSOR_NAMES[role].format(bid=bid)}.{suffix}"
        plan.append(_Tensor(name, keys, stacked, shape, ttype))

    n_experts = adapter.num_experts(config)
    add(Role.TOKEN_EMBD, [adapter.disk_embeddings_key()])
    for i in range(config.num_hidden_layers):
        add(Role.ATTN_NORM, [adapter.disk_input_norm_key(i)], i)
        for role, proj in ((Role.ATTN_Q, "q_proj"), (Role.ATTN_K, "k_proj"),
                           (Role.ATTN_V, "v_proj"), (Role.ATTN_OUT, "o_proj")):
            add(role, [adapter.disk_attention_key(i, proj)], i)
            if adapter.disk_attention_key(i, proj) + ".bias" in reader:
                add(role, [adapter.disk_attention_key(i, proj)], i, suffix="bias")
        for role, name in ((Role.ATTN_Q_NORM, "q_norm"), (Role.ATTN_K_NORM, "k_norm")):
            if adapter.disk_attention_key(i, name) + ".weight" in reader:
                add(role, [adapter.disk_attention_key(i, name)], i)
        add(Role.FFN_NORM, [adapter.disk_post_attention_norm_key(i)], i)
        if not adapter.is_moe:
            for role, proj in ((Role.FFN_GATE, "gate_proj"), (Role.FFN_UP, "up_proj"),
                               (Role.FFN_DOWN, "down_proj")):
                add(role, [adapter.disk_dense_mlp_key(i, proj)], i)
            continue
        if adapter.disk_router_key(i) + ".weight" not in reader:
            raise ExportError(f"{reader.path}: layer {i} has no router; llama.cpp's "
                              f"{gguf.MODEL_ARCH_NAMES[arch.arch]} expects experts in every layer")
        add(Role.FFN_GATE_INP, [adapter.disk_router_key(i)], i)
        for role, proj in ((Role.FFN_GATE_EXP, "gate"), (Role.FFN_UP_EXP, "up"),
                           (Role.FFN_DOWN_EXP, "down")):
            add(role, [adapter.disk_expert_key(i, e, proj) for e in range(n_experts)], i,
                stacked=True)
        if adapter.disk_shared_expert_gate_key(i) + ".weight" in reader:
            add(Role.FFN_GATE_INP_SHEXP, [adapter.disk_shared_expert_gate_key(i)], i)
            for role, proj in ((Role.FFN_GATE_SHEXP, "gate_proj"), (Role.FFN_UP_SHEXP, "up_proj"),
                               (Role.FFN_DOWN_SHEXP, "down_proj")):
                add(role, [adapter.disk_shared_expert_key(i, proj)], i)
    add(Role.OUTPUT_NORM, [adapter.disk_final_norm_key()])
    head = adapter.disk_lm_head_key() + ".weight"
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if not tied:
        add(Role.OUTPUT, [adapter.disk_lm_head_key()])

    used = {k for t in plan for k in t.keys} | ({head} if tied else set())
    unused = sorted(set(reader.tensor_names()) - used)
    if unused:
        raise ExportError(f"{reader.path}: tensors with no GGUF counterpart: {unused[:4]}"
                          + (f" and {len(unused) - 4} more" if len(unused) > 4 else ""))
    return plan


def _write_metadata(writer: gguf.GGUFWriter, model_dir: Path, config, adapter: Adapter,
                    reader: CheckpointReader, qtype: QType) -> None:
    """The hyperparameters llama.cpp reads; sizes come from the tensors where the config names
    them differently per family."""
    heads = int(config.num_attention_heads)
    head_dim = reader.shape(adapter.disk_attention_key(0, "q_proj") + ".weight")[0] // heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name(model_dir.name)
    writer.add_file_type(_FILE_TYPES[qtype])
    if qtype not in _PLAIN_NUMPY and qtype != QType.BF16:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.num_key_value_heads))
    writer.add_key_length(int(head_dim))
    writer.add_value_length(int(head_dim))
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if adapter.is_moe:
        expert_ffn = reader.shape(adapter.disk_expert_key(0, 0, "gate") + ".weight")[0]
        writer.add_expert_feed_forward_length(int(expert_ffn))
        writer.add_expert_count(adapter.num_experts(config))
        writer.add_expert_used_count(adapter.top_k(config))
        shared = adapter.disk_shared_expert_key(0, "gate_proj") + ".weight"
        if shared in reader:
            writer.add_expert_shared_feed_forward_length(int(reader.shape(shared)[0]))


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with GPT-2's pre-tokenizer as llama.cpp's ``gpt2`` model:
    tokens padded to the model's vocabulary, token types, merges, special ids."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_dir}: no tokenizer.json; GGUF files carry their tokenizer")
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
