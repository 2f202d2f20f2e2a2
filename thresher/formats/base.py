"""What every checkpoint format answers, so that readers ask the format instead of branching on
its name.

A format is one object (``formats.registry.FORMATS``): the tensors it writes per linear layer,
their shapes for an [out, in] weight, the check that a set of tensors is well formed, packing,
unpacking, dequantizing and its ``quantization_config``. The loader, the serving engine, the GGUF
exporter and the compressors hold a format object and call these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from thresher.errors import CheckpointError

Shape = tuple[int, ...]


class CheckpointFormat(ABC):
    """One checkpoint layout of a quantized linear layer (tensor names relative to the module)."""

    kind: ClassVar[str]  # the name a method's ``format`` and ``PackedFormat.kind`` use
    marker: ClassVar[str]  # the tensor whose presence marks a module packed in this format
    tensors: ClassVar[tuple[str, ...]]  # every tensor it may write, in writing order
    required: ClassVar[tuple[str, ...]]  # the ones each packed module must hold
    integer_grid: ClassVar[bool]  # codes with a scale and zero per group (QuantizedWeight)
    min_zero: ClassVar[int] = 0  # the smallest zero point the layout can store

    @abstractmethod
    def packed_shapes(self, out_features: int, in_features: int, bits: int,
                      group_size: int) -> dict[str, Shape]:
        """The shapes of the required tensors of an [out, in] weight."""

    @abstractmethod
    def pack(self, weight: Any) -> dict[str, torch.Tensor]:
        """The in-memory quantized weight -> its tensors."""

    @abstractmethod
    def unpack(self, tensors: Mapping[str, torch.Tensor], bits: int, group_size: int) -> Any:
        """Its tensors -> the in-memory quantized weight (the inverse of ``pack``)."""

    @abstractmethod
    def read_config(self, qc: Mapping[str, Any]) -> dict[str, Any] | None:
        """``PackedFormat`` fields (bits, group_size, dynamic) when ``quantization_config``
        describes this layout, else None."""

    @abstractmethod
    def quantization_config(self, **fields: Any) -> dict:
        """The ``quantization_config`` block of config.json for this layout."""

    def settings_problem(self, bits: int, group_size: int) -> str | None:
        """Why no weight at ``bits`` in groups of ``group_size`` can be written in this layout
        (None: some can), naming the setting."""
        return None

    def layout_problem(self, out_features: int, in_features: int, bits: int) -> str | None:
        """Why an [out, in] weight at ``bits`` cannot be written in this layout (None: it can)."""
        return None

    def dequantize(self, tensors: Mapping[str, torch.Tensor], bits: int,
                   group_size: int) -> torch.Tensor:
        """The float32 weight [out, in] the tensors hold."""
        return self.unpack(tensors, bits, group_size).dequantize()

    @abstractmethod
    def matrix_shape(self, shapes: Mapping[str, Shape], bits: int) -> tuple[int, int] | None:
        """[out, in] of the weight from its tensors' shapes alone; None where the shapes do not
        tell (the layout keeps it elsewhere)."""

    def require(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        """Refuse a tensor set that lacks one of the required tensors, naming it."""
        for name in self.required:
            if name not in tensors:
                raise CheckpointError(f"{where}: {self.kind} tensor {name} is missing")

    def check(self, tensors: Mapping[str, torch.Tensor], out_features: int, in_features: int,
              bits: int, group_size: int, where: str) -> None:
        """Refuse tensors that do not hold an [out, in] weight in this layout, naming the first
        tensor that is missing or misshapen (``where``: the file and module)."""
        self.require(tensors, where)
        expected = self.packed_shapes(out_features, in_features, bits, group_size)
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise CheckpointError(
                    f"{where}.{name}: shape {tuple(tensors[name].shape)}, but a {self.kind} "
                    f"[{out_features}, {in_features}] weight at {bits} bits has {shape}")


def groups(in_features: int, group_size: int) -> int:
    """Groups along the inputs (-1: one group per row)."""
    return 1 if group_size == -1 else -(-in_features // group_size)
