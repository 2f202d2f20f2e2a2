"""A published artifact (directory or ``models:/name/version``) -> the engine's model.

Reads safetensors directly under the hub-canonical names thresher publishes (per-expert keys,
GPTQ/AWQ tensor sets, bitsandbytes NF4 state), checks ``thresher.json`` hashes first when the
artifact has one, and builds ``modeling.decoder.CausalLM`` layer by layer. Which switches a family
needs (q/k norms, biases, shared expert, dense layers) is read from the tensors present; the
adapter supplies the family facts that are not in the checkpoint (expert names, router rule, each
MoE layer's expert count, which differs per layer after a damage-budget prune).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from thresher.errors import ArtifactError, CheckpointError
from thresher.formats.config import PackedFormat, packed_format
from thresher.formats.dtypes import DTYPES
from thresher.formats.registry import FORMATS
from thresher.models.adapters import (
    ATTENTION_PROJECTIONS,
    EXPERT_ROLES,
    MLP_PROJECTIONS,
    Adapter,
    get_adapter,
)
from thresher.models.checkpoint import CheckpointReader, expected_tensors
from thresher.models.layerwise import load_config
from thresher.models.manifest import verify_artifact
from thresher.models.source import resolve_model
from thresher.serve_kernels.kernels import cpu_native, rotary_cos_sin
from thresher.serve_kernels.modeling import gpt_oss, native_step
from thresher.serve_kernels.modeling.decoder import (
    Attention,
    CausalLM,
    DecoderLayer,
    DenseMLP,
    ModelSpec,
)
from thresher.serve_kernels.modeling.deltanet import GatedAttention, GatedDeltaNet
from thresher.serve_kernels.modeling.linear import (
    DenseLinear,
    Linear,
    load_linear,
    pack_for_cpu,
    packed_bytes,
)
from thresher.serve_kernels.modeling.mla import LatentAttention
from thresher.serve_kernels.modeling.moe import MoE, stack_experts

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """The engine model plus what the engine reports about it."""

    model: CausalLM
    path: Path
    config: object
    info: dict = field(default_factory=dict)
    manifest: dict | None = None


class _Builder:
    """Reads one artifact's tensors into engine modules, counting parameters as it goes."""

    def __init__(self, reader: CheckpointReader, quant: PackedFormat | None, dtype: torch.dtype,
                 expected: dict[str, tuple[int, ...]]):
        self.reader, self.quant, self.dtype = reader, quant, dtype
        self.expected = expected  # disk name -> the shape config.json gives it
        self.params = 0

    def linear(self, prefix: str, dtype: torch.dtype | None = None) -> Linear:
        want = self.expected.get(f"{prefix}.weight")
        module = load_linear(self.reader, prefix, self.quant, dtype or self.dtype,
                             None if want is None else tuple(want))
        if want is not None and (module.out_features, module.in_features) != want:
            raise CheckpointError(
                f"{self.reader.path}: {prefix} holds a [{module.out_features}, "
                f"{module.in_features}] weight, config.json makes it {list(want)}")
        self.params += module.in_features * module.out_features
        self.params += 0 if module.bias is None else module.bias.numel()
        return module

    def tensor(self, key: str) -> torch.Tensor:
        t = self.reader.get(key).to(self.dtype)
        self.params += t.numel()
        return t

    def has_linear(self, prefix: str) -> bool:
        return any(f"{prefix}.{n}" in self.reader
                   for n in ("weight", *(f.marker for f in FORMATS.values())))


def _rotary(config, adapter: Adapter) -> tuple[torch.Tensor, float]:
    """The family's own inverse frequencies (any RoPE scaling in the config applied)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    rotary = type(adapter.rotary_embedding(skeleton))(config=config)
    return rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))


def _moe(b: _Builder, adapter: Adapter, config, i: int) -> MoE:
    count = adapter.layer_num_experts(config, i)  # per layer after a damage-budget prune
    experts = {r: [b.linear(adapter.disk_expert_key(i, e, r)) for e in range(count)]
               for r in EXPERT_ROLES}
    shared = shared_gate = None
    if b.has_linear(adapter.disk_shared_expert_key(i, MLP_PROJECTIONS[0])):
        shared = DenseMLP(*(b.linear(adapter.disk_shared_expert_key(i, p)) for p in MLP_PROJECTIONS))
        if b.has_linear(adapter.disk_shared_expert_gate_key(i)):
            shared_gate = b.linear(adapter.disk_shared_expert_gate_key(i))
    correction = adapter.disk_router_correction_key(i)
    has_correction = correction is not None and correction in b.reader
    rule = adapter.rule(config, b.reader.get(correction) if has_correction else None)
    router_dtype = torch.float32 if adapter.spec.fp32_router else None  # as the family computes it
    return MoE(b.linear(adapter.disk_router_key(i), router_dtype),
               stack_experts(*(experts[r] for r in EXPERT_ROLES)),
               adapter.top_k(config), adapter.forward_renormalizes(config), shared, shared_gate,
               rule)


def _latent_attention(b: _Builder, adapter: Adapter, config, i: int) -> LatentAttention:
    """DeepSeek-V3's attention of layer ``i``; kv_b is dequantized once (it is absorbed into
    the query and the output, see ``modeling.mla``)."""
    def key(name: str) -> str:
        return adapter.disk_attention_key(i, name)

    has_q_rank = b.has_linear(key("q_a_proj"))
    return LatentAttention(
        config, b.linear(key("q_a_proj")) if has_q_rank else None,
        b.tensor(key("q_a_layernorm") + ".weight") if has_q_rank else None,
        b.linear(key("q_b_proj" if has_q_rank else "q_proj")), b.linear(key("kv_a_proj_with_mqa")),
        b.tensor(key("kv_a_layernorm") + ".weight"),
        b.linear(key("kv_b_proj")).dequantized().to(b.dtype), b.linear(key("o_proj")))


def _deltanet(b: _Builder, adapter: Adapter, config, i: int) -> GatedDeltaNet:
    """Qwen3.5's Gated DeltaNet of layer ``i`` (in_proj_a / in_proj_b, conv1d and the decay
    parameters as stored; the projections quantized or not)."""
    def key(name: str) -> str:
        return f"{adapter.disk_layer_prefix(i)}linear_attn.{name}"

    return GatedDeltaNet(
        b.linear(key("in_proj_qkv")), b.linear(key("in_proj_z")), b.linear(key("in_proj_b")),
        b.linear(key("in_proj_a")), b.tensor(key("conv1d.weight")),
        b.reader.get(key("A_log")).float(), b.reader.get(key("dt_bias")).float(),
        b.tensor(key("norm.weight")), b.linear(key("out_proj")),
        num_k_heads=int(config.linear_num_key_heads),
        num_v_heads=int(config.linear_num_value_heads),
        head_k_dim=int(config.linear_key_head_dim), head_v_dim=int(config.linear_value_head_dim),
        eps=float(config.rms_norm_eps))


def _spec(config, adapter: Adapter) -> ModelSpec:
    heads = config.num_attention_heads
    if adapter.attention_kind == "mla":  # one cache row per token: latent plus rotary key
        kv_heads, head_dim, tensors = 1, config.kv_lora_rank + config.qk_rope_head_dim, 1
    else:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim, tensors = getattr(config, "head_dim", None) or config.hidden_size // heads, 2
    return ModelSpec(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=config.vocab_size,
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=config.max_position_embeddings, kv_tensors=tensors,
        recurrent_layers=tuple(adapter.linear_attention_layers(config)),
    )


@torch.no_grad()
def load_engine_model(source: str | Path, dtype: str | torch.dtype = "float32",
                      device: str | torch.device = "cpu", show_progress: bool = False
                      ) -> LoadedModel:
    """Build the engine model of an artifact directory or ``models:/name/version`` URI."""
    path = resolve_model(str(source))
    manifest = verify_artifact(path)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = load_config(path, dequantized=True)  # MXFP4 experts: dequantized as read
    adapter = get_adapter(config)
    quant = packed_format(config, path)
    if quant is not None:
        del config.quantization_config
    spec = _spec(config, adapter)
    reader = CheckpointReader(path)
    expected = expected_tensors(config)
    reader.check_against_config(config, expected)
    b = _Builder(reader, quant, dtype, expected)
    inv_freq, scaling = _rotary(config, adapter)
    rotary_dim = 2 * inv_freq.numel()  # less than head_dim with partial rotary (GLM-4.5)

    def norm(key: str) -> torch.Tensor:  # zero-centered norms (Qwen3.5) multiply by 1 + weight
        return b.tensor(key) + adapter.norm_weight_offset if adapter.norm_weight_offset else \
            b.tensor(key)

    layers = []
    linear = set(adapter.linear_attention_layers(config))
    for i in tqdm(range(spec.num_layers), desc="loading layers", disable=not show_progress):
        if i in linear:
            attn = _deltanet(b, adapter, config, i)
        elif adapter.attention_kind == "mla":
            attn = _latent_attention(b, adapter, config, i)
        elif adapter.gated_attention:
            attn = GatedAttention(spec, *(b.linear(adapter.disk_attention_key(i, n))
                                          for n in ATTENTION_PROJECTIONS),
                                  norm(adapter.disk_attention_key(i, "q_norm") + ".weight"),
                                  norm(adapter.disk_attention_key(i, "k_norm") + ".weight"),
                                  rotary_dim=rotary_dim)
        else:
            norm_keys = {n: adapter.disk_attention_key(i, n) + ".weight"
                         for n in ("q_norm", "k_norm")}
            attn_norms = {n: b.tensor(key) for n, key in norm_keys.items() if key in reader}
            attn_args = (spec, *(b.linear(adapter.disk_attention_key(i, n))
                                 for n in ATTENTION_PROJECTIONS),
                         attn_norms.get("q_norm"), attn_norms.get("k_norm"),
                         getattr(config, "clip_qkv", None), rotary_dim,
                         adapter.interleaved_rotary)
            sinks = adapter.disk_attention_key(i, "sinks")
            if sinks in reader:  # gpt-oss: sinks, and a window in sliding layers
                attn = gpt_oss.SinkAttention(*attn_args, sinks=b.tensor(sinks),
                                             window=adapter.sliding_window(config, i))
            else:
                attn = Attention(*attn_args)
        if adapter.is_moe and b.has_linear(adapter.disk_router_key(i)):
            mlp = (gpt_oss.build_moe(b, adapter, config, i)
                   if adapter.rule(config).scoring == "topk_softmax" else _moe(b, adapter, config, i))
        else:
            mlp = DenseMLP(*(b.linear(adapter.disk_dense_mlp_key(i, n)) for n in MLP_PROJECTIONS))
        layers.append(DecoderLayer(attn, mlp, norm(adapter.disk_input_norm_key(i) + ".weight"),
                                   norm(adapter.disk_post_attention_norm_key(i) + ".weight"),
                                   spec.rms_norm_eps))

    embed = b.tensor(adapter.disk_embeddings_key() + ".weight")
    if b.has_linear(adapter.disk_lm_head_key()):
        lm_head = b.linear(adapter.disk_lm_head_key())
    elif getattr(config, "tie_word_embeddings", False):
        lm_head = DenseLinear(embed, tied=True)
    else:
        raise ArtifactError(f"{path}: no lm_head.weight and tie_word_embeddings is off")
    cos_sin = rotary_cos_sin(inv_freq, spec.max_position_embeddings, scaling)
    model = CausalLM(spec, embed, layers, norm(adapter.disk_final_norm_key() + ".weight"),
                     lm_head, cos_sin)
    weight_bytes = packed_bytes(model) - cos_sin.numel() * cos_sin.element_size()
    model = model.to(device).eval()
    if torch.device(device).type == "cpu":
        cpu_native.library()  # thresher's C kernels, built on first use: packs and norms use them
        pack_for_cpu(model, dtype)
        model.native_step = native_step.build(model)  # decode steps in one C call
    info = {
        "format": "bf16" if quant is None else quant.kind,
        "bits": 16 if quant is None else "mixed" if quant.mixed else quant.bits,
        "dtype": str(dtype).removeprefix("torch."),
        "model_type": config.model_type,
        "attention": adapter.attention_kind,
        "num_experts": adapter.num_experts(config),  # the largest layer's, with per-layer counts
        "layer_num_experts": getattr(config, "layer_num_experts", None),
        "params": b.params,
        "weight_bytes": weight_bytes,
    }
    log.info("loaded %s (%s, %d params, %.1f MB of weights)", path, info["format"], b.params,
             weight_bytes / 2**20)
    return LoadedModel(model, path, config, info, manifest)
