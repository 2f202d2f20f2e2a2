"""Which implementation a kernel call runs: the Triton kernel or its PyTorch reference.

Triton needs a GPU; without one the engine runs each kernel's PyTorch reference, or, for layouts
converted at load time for torch's CPU kernels (``cpu_int4``), those kernels. The default is
therefore decided by where the input lives (CUDA tensor -> Triton, CPU tensor -> CPU kernel where
the layer has one, else the reference), and ``THRESHER_KERNELS=triton|torch`` overrides it for the
whole process (``torch`` = the dequantizing references, which tests compare the fast paths with).

Tests run the Triton kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``).
``@triton.jit`` decides between a compiled and an interpreted kernel when the decorator runs, so a
kernel module imported before the variable was set holds compiled kernels; ``launcher`` wraps such
a kernel in the interpreter at launch time, which makes the result independent of the kernel
modules' import order. Triton's own library functions (``tl.sum``, ``tl.sigmoid``) are
``@triton.jit`` functions too, decided when ``triton`` is first imported, and a compiled one cannot
run inside the interpreter: where ``triton`` was imported without the variable (a GPU machine),
``launcher`` refuses CPU tensors with that reason instead of failing inside a kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton.language as tl

ENV_VAR = "THRESHER_KERNELS"
_interpreted: dict[Any, Any] = {}


# os.environ.get costs ~2 us (a Mapping lookup that encodes the key); a decode step asks a few
# hundred times, so read the byte-keyed store that os.environ keeps in step with the process
# environment (os.environ._data: CPython's, on POSIX) where it exists.
_ENV_STORE = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEY = os.fsencode(ENV_VAR)


def _choice() -> str:
    """The override in ``THRESHER_KERNELS``: "", "triton" or "torch" (read on every call, since
    tests switch it at run time)."""
    raw = _ENV_STORE.get(_ENV_KEY) if _ENV_STORE is not None else os.environ.get(ENV_VAR)
    if not raw:
        return ""
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    choice = raw.strip().lower()
    if choice not in ("", "triton", "torch"):
        raise ValueError(f"{ENV_VAR}={choice!r}: expected 'triton' or 'torch' (or unset)")
    return choice


def use_triton(x: torch.Tensor) -> bool:
    """True when calls on ``x`` should run the Triton kernel rather than the reference."""
    choice = _choice()
    return choice == "triton" if choice else x.is_cuda


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """True when calls on ``x`` may run a CPU kernel over weights converted at load time."""
    return not x.is_cuda and _choice() == ""


def interpreting() -> bool:
    """True when Triton's interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def launcher(kernel: Any, x: torch.Tensor) -> Any:
    """The object to launch ``kernel[grid](...)`` with for tensors on ``x``'s device."""
    if x.is_cuda:
        return kernel
    if not interpreting():
        raise RuntimeError(
            "Triton kernels need a CUDA device; set TRITON_INTERPRET=1 to run them on CPU tensors "
            f"(slowly), or {ENV_VAR}=torch to use the PyTorch references"
        )
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if not isinstance(standard.sigmoid, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first "
            "imported (its library functions were compiled); on a GPU pass CUDA tensors, or set "
            f"{ENV_VAR}=torch to use the PyTorch references"
        )
    if kernel.fn not in _interpreted:
        _interpreted[kernel.fn] = InterpretedFunction(kernel.fn)
    return _interpreted[kernel.fn]


# fp32 operands of ``tl.dot`` in IEEE precision. Triton's NVIDIA backend otherwise rounds them to
# TF32 (10-bit mantissa) on tensor cores, while the interpreter that tests the kernels on the CPU
# computes true fp32: fp32 serving (parity runs, small models) would then differ on a GPU from
# what the tests pinned. 16-bit operands, the GPU default, ignore the setting and keep the MMA path.
DOT_PRECISION = tl.constexpr("ieee")


def dot_dtype(x: torch.Tensor) -> tl.dtype:
    """Operand type for ``tl.dot`` on activations ``x``: their own 16-bit type, else fp32.

    The interpreter (CPU tensors) computes bf16 arithmetic wrongly, so there bf16 goes through fp32.
    """
    if x.dtype == torch.float16:
        return tl.float16
    if x.dtype == torch.bfloat16 and x.is_cuda:
        return tl.bfloat16
    return tl.float32


@dataclass(frozen=True)
class TileConfig:
    """One shipped launch configuration of a tiled matmul kernel (tests AOT-compile each)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @property
    def constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k}

    @property
    def launch(self) -> dict[str, int]:
        return {**self.constexprs, "num_warps": self.num_warps, "num_stages": self.num_stages}
