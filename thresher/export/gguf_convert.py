"""Value conversions between a checkpoint tensor and its GGUF counterpart, and the Gated DeltaNet
tensors of llama.cpp's hybrid graphs (``qwen35moe``).

llama.cpp's converter stores some tensors transformed: zero-centered RMSNorm weights with the 1
added (its graph multiplies by the weight), ``A_log`` as ``ssm_a = -exp(A_log)``, and, where a
DeltaNet has fewer key heads than value heads, the value heads reordered from grouped by key head
(``k0v0 k0v1 k1v0 k1v1``) to tiled (``k0v0 k1v0 k0v1 k1v1``) so that its broadcasts line up: the
value rows of ``in_proj_qkv`` and of the conv kernel, the rows of ``in_proj_z`` / ``in_proj_a`` /
``in_proj_b``, the entries of ``A_log`` / ``dt_bias``, and the input columns of ``out_proj``.
``Conversion`` applies one tensor's transform and inverts it (``dequantize_gguf``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np

Role = gguf.MODEL_TENSOR


@dataclass(frozen=True)
class VHeads:
    """Value heads grouped by key head, ``num_k`` groups of ``per_k`` heads of ``head_dim``
    channels, from channel ``start`` of the axis on."""

    num_k: int
    per_k: int
    head_dim: int
    start: int = 0

    def order(self) -> np.ndarray:
        """Source channel of each tiled position (over the reordered span)."""
        idx = np.arange(self.num_k * self.per_k * self.head_dim)
        return idx.reshape(self.num_k, self.per_k, self.head_dim).transpose(1, 0, 2).reshape(-1)

    def permute(self, data: np.ndarray, axis: int, inverse: bool = False) -> np.ndarray:
        order = self.order()
        if inverse:
            order = np.argsort(order)
        index = np.concatenate([np.arange(self.start), self.start + order])
        return np.take(data, index, axis=axis)


@dataclass(frozen=True)
class Conversion:
    """How a checkpoint tensor's values become the GGUF tensor's: ``-exp`` first (A_log), then
    ``offset`` added (zero-centered norms), then value heads reordered along the rows (``rows``)
    or the input columns (``cols``)."""

    offset: float = 0.0
    neg_exp: bool = False
    rows: VHeads | None = None
    cols: VHeads | None = None

    def apply(self, data: np.ndarray) -> np.ndarray:
        if self.neg_exp:
            data = -np.exp(data)
        if self.offset:
            data = data + np.float32(self.offset)
        if self.rows is not None:
            data = self.rows.permute(data, 0)
        if self.cols is not None:
            data = self.cols.permute(data, -1)
        return data

    def invert(self, data: np.ndarray) -> np.ndarray:
        if self.cols is not None:
            data = self.cols.permute(data, -1, inverse=True)
        if self.rows is not None:
            data = self.rows.permute(data, 0, inverse=True)
        if self.offset:
            data = data - np.float32(self.offset)
        if self.neg_exp:
            data = np.log(-data)
        return data

    def permute_blocks(self, blocks: np.ndarray, cols: int, block: int, where: str
                       ) -> np.ndarray:
        """The same transform on the quantized blocks [rows, cols / block * bytes] of a packed
        matrix: rows move whole; columns move in whole blocks, so a head must span whole ones."""
        if self.offset or self.neg_exp:
            raise ValueError(f"{where}: a value transform cannot apply to packed codes")
        if self.rows is not None:
            blocks = self.rows.permute(blocks, 0)
        if self.cols is not None:
            heads = self.cols
            if heads.head_dim % block or heads.start % block:
                raise ValueError(f"{where}: value heads of {heads.head_dim} columns do not span "
                                 f"whole blocks of {block}; export the 16-bit model instead")
            coarse = VHeads(heads.num_k, heads.per_k, heads.head_dim // block,
                            heads.start // block)
            grouped = blocks.reshape(blocks.shape[0], cols // block, -1)
            blocks = coarse.permute(grouped, 1).reshape(blocks.shape)
        return blocks


def plan_deltanet(add: Callable[..., None], adapter, config, i: int) -> None:
    """Layer ``i``'s Gated DeltaNet tensors under llama.cpp's names and layouts (``add`` as in
    ``export.gguf._plan``: role, modules, block, suffix, gguf_suffix, shape, conversion)."""
    key_dim = int(config.linear_key_head_dim) * int(config.linear_num_key_heads)
    num_k, num_v = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    per_k, head_v = num_v // num_k, int(config.linear_value_head_dim)

    def heads(dim: int, start: int = 0) -> VHeads | None:
        return VHeads(num_k, per_k, dim, start) if per_k > 1 else None

    module = adapter.disk_layer_prefix(i) + "linear_attn"

    def m(name: str) -> str:
        return f"{module}.{name}"

    add(Role.ATTN_QKV, [m("in_proj_qkv")], i,
        conversion=Conversion(rows=heads(head_v, 2 * key_dim)))
    add(Role.ATTN_GATE, [m("in_proj_z")], i, conversion=Conversion(rows=heads(head_v)))
    add(Role.SSM_BETA, [m("in_proj_b")], i, conversion=Conversion(rows=heads(1)))
    add(Role.SSM_ALPHA, [m("in_proj_a")], i, conversion=Conversion(rows=heads(1)))
    add(Role.SSM_A, [module], i,
        suffix="A_log", gguf_suffix="", conversion=Conversion(neg_exp=True, rows=heads(1)))
    add(Role.SSM_DT, [module], i,
        suffix="dt_bias", gguf_suffix="bias", conversion=Conversion(rows=heads(1)))
    conv_channels = 2 * key_dim + num_v * head_v
    add(Role.SSM_CONV1D, [m("conv1d")], i, shape=(conv_channels, int(config.linear_conv_kernel_dim)),
        conversion=Conversion(rows=heads(head_v, 2 * key_dim)))
    add(Role.SSM_NORM, [m("norm")], i)  # a plain RMSNorm (weight, not 1 + weight)
    add(Role.SSM_OUT, [m("out_proj")], i, conversion=Conversion(cols=heads(head_v)))


def write_deltanet_metadata(writer: gguf.GGUFWriter, config, adapter) -> None:
    """The hybrid graph's keys, as llama.cpp's converter writes them: the conv kernel, the state
    size (key head width), the key heads (groups), the value heads (time-step rank), the value
    width, every how many layers a full-attention one comes, and the M-RoPE sections (text
    positions repeat on every section, so they rotate as plain rotary)."""
    writer.add_ssm_conv_kernel(int(config.linear_conv_kernel_dim))
    writer.add_ssm_state_size(int(config.linear_key_head_dim))
    writer.add_ssm_group_count(int(config.linear_num_key_heads))
    writer.add_ssm_time_step_rank(int(config.linear_num_value_heads))
    writer.add_ssm_inner_size(int(config.linear_value_head_dim)
                              * int(config.linear_num_value_heads))
    writer.add_full_attention_interval(adapter.full_attention_interval(config))
    rope = getattr(config, "rope_parameters", None) or {}
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    writer.add_rope_dimension_sections((sections + [0] * 4)[:4])
