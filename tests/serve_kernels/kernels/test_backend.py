"""The backend switch: env override, and interpreted launches whatever the import order."""

from __future__ import annotations

import pytest
import torch
from triton.language import standard
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from thresher.serve_kernels.kernels import activation, backend


def test_use_triton_follows_device_and_env(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert not backend.use_triton(torch.zeros(1))
    monkeypatch.setenv(backend.ENV_VAR, "Triton")
    assert backend.use_triton(torch.zeros(1))
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert not backend.use_triton(torch.zeros(1))
    monkeypatch.setenv(backend.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match=backend.ENV_VAR):
        backend.use_triton(torch.zeros(1))


def test_compiled_kernel_runs_interpreted_on_cpu(monkeypatch):
    """A kernel decorated before TRITON_INTERPRET was set still runs on CPU tensors, as long as
    triton itself was imported under the interpreter; where it was not (a GPU machine), the
    launch is refused with that reason instead of failing inside the kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compiled = JITFunction(activation._silu_and_mul_kernel.fn)
    x = torch.randn(2, 20)
    out = torch.empty(2, 10)
    if not isinstance(standard.sigmoid, InterpretedFunction):
        with pytest.raises(RuntimeError, match="before triton is first imported"):
            backend.launcher(compiled, x)
        return
    backend.launcher(compiled, x)[(2, 1)](x, out, 10, BLOCK=16)
    assert torch.allclose(out, activation.silu_and_mul_ref(x), atol=1e-6)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.launcher(compiled, x)
