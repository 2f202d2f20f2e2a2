"""Where the compression stages compute: the device setting and the calibration activations.

The layer-by-layer stages (REAP observation, GPTQ, AWQ, RTN, NF4) move each decoder layer to the
device when its turn comes and bring the results back to the host for writing. The activations
flowing between layers stay on the device up to a byte budget; the batches beyond it wait in host
memory (pinned, on CUDA, so copies back are asynchronous) and travel to the device one at a time.
On the CPU every step runs through the same code, with the device and the host being one memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from thresher.errors import CompressionError
from thresher.recipe import DEVICE_PATTERN

DEVICE_HELP = "'auto' (CUDA when available, else the CPU), 'cpu', 'cuda' or 'cuda:N'"
ACTIVATION_SHARE = 0.5  # default budget on CUDA: this share of the device memory free at start


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """The torch device ``spec`` names; a clear error when it asks for CUDA that is not there."""
    text = str(spec)
    if not re.match(DEVICE_PATTERN, text):
        raise CompressionError(f"device {text!r}: choose {DEVICE_HELP}")
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CompressionError(
                f"device {text!r}: no CUDA device is available to this PyTorch "
                f"({torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use "
                "--device cpu (or auto)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise CompressionError(f"device {text!r}: this machine has {count} CUDA device(s), "
                                   f"cuda:0 to cuda:{count - 1}")
    return device


def activation_budget(device: torch.device, budget_gb: float | None) -> float:
    """Bytes of calibration activations kept on ``device``: ``budget_gb`` when given; else, on
    CUDA, ``ACTIVATION_SHARE`` of the free device memory, and on the CPU no limit."""
    if budget_gb is not None:
        return budget_gb * 2**30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return ACTIVATION_SHARE * free
    return float("inf")


@dataclass(frozen=True)
class Compute:
    """The execution setting of a stage: its device and activation budget (not its content)."""

    device: torch.device
    budget_bytes: float

    @classmethod
    def resolve(cls, device: str | torch.device = "auto",
                offload_budget_gb: float | None = None) -> Compute:
        dev = resolve_device(device)
        return cls(dev, activation_budget(dev, offload_budget_gb))

    @property
    def name(self) -> str:
        return str(self.device)


class ActivationStore:
    """Batches of calibration activations: on the device while the budget allows, the rest in
    host memory (pinned with CUDA). Reading a batch gives it on the device either way."""

    def __init__(self, device: torch.device, budget_bytes: float):
        self.device = device
        self.budget = budget_bytes
        self.pin = device.type == "cuda"
        self._items: list[torch.Tensor] = []
        self._on_device: list[bool] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for t, d in zip(self._items, self._on_device, strict=True) if d)

    @property
    def offloaded(self) -> int:
        """How many batches are held in host memory."""
        return self._on_device.count(False)

    def append(self, t: torch.Tensor) -> None:
        self._items.append(t)
        self._on_device.append(True)
        self[len(self._items) - 1] = t

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        self._on_device[i] = False  # the old value's bytes no longer count
        keep = self.device_bytes + t.nbytes <= self.budget
        if keep:
            self._items[i] = t if t.device == self.device else t.to(self.device)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            self._items[i] = host.copy_(t)
        self._on_device[i] = keep

    def __getitem__(self, i: int) -> torch.Tensor:
        t = self._items[i]
        return t if self._on_device[i] else t.to(self.device, non_blocking=self.pin)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self[i]
