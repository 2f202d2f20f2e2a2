"""Shared pieces of the kernel tests: the device, an error measure, layout packers, AOT compiles.

The packers here are written independently of the kernels' unpacking code, from the layouts in
shared/reference/formats.md, so a reference that unpacks wrongly disagrees with them.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

ROOT = Path(__file__).resolve().parents[3]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: [K, N] nibbles -> int32 [K/8, N], row 8r+j at bits 4j."""
    k, n = q.shape
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        words |= q[j::8].long() << (4 * j)
    return _to_int32(words)


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, N] nibbles -> int32 [R, N/8], nibble i of word c holding column 8c + order[i]."""
    r, n = q.shape
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        words |= q[:, col::8].long() << (4 * i)
    return _to_int32(words)


def random_gptq(k: int, n: int, group_size: int, act_order: bool, dtype=torch.float16, seed=0):
    """A random GPTQ v1 tensor set and its dense weight W [K, N] (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(1, 16, (groups, n), generator=gen)  # v1 stores z - 1 >= 0
    s = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).to(dtype)
    g_idx = torch.arange(k) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    w = s.float()[g_idx] * (q - z[g_idx]).float()
    tensors = (pack_rows(q), pack_cols(z - 1), s, g_idx.to(torch.int32))
    return tuple(t.to(DEVICE) for t in tensors), w


def random_awq(k: int, n: int, group_size: int, dtype=torch.float16, seed=0):
    """A random AWQ gemm tensor set and its dense weight W [K, N] (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    g = k if group_size == -1 else group_size
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.005).to(dtype)
    rows = torch.arange(k) // g
    w = (q - z[rows]).float() * s.float()[rows]
    tensors = (pack_cols(q, AWQ_ORDER), pack_cols(z, AWQ_ORDER), s)
    return tuple(t.to(DEVICE) for t in tensors), w


@dataclass
class AotSpec:
    """One shipped kernel configuration to compile ahead of time.

    ``kernel`` is "module:attribute"; arguments named in ``constexprs`` are constexpr (a string
    "tl.<dtype>" stands for that Triton dtype), the others take their type from ``types``
    (default i32). ``ptx_forbids``: strings the compiled PTX must not contain (e.g. "tf32").
    """

    kernel: str
    types: dict[str, str]
    constexprs: dict[str, int | str]
    num_warps: int = 4
    num_stages: int = 3
    archs: tuple[int, ...] = (80, 90)
    ptx_forbids: tuple[str, ...] = ()


def aot_compile_all(specs: list[AotSpec]) -> None:
    """Compile every spec for each of its archs in a fresh interpreter-free Python process.

    A process that has run interpreted kernels can leave Triton's language patched for the
    interpreter, which breaks later compilations, so the compiler gets a clean process.
    """
    payload = json.dumps([asdict(s) for s in specs])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "tests.serve_kernels.kernels.helpers"],
                          input=payload, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


def _compile(spec: AotSpec, arch: int) -> None:
    module, name = spec.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) else v
                  for k, v in spec.constexprs.items()}
    signature = {n: "constexpr" if n in constexprs else spec.types.get(n, "i32")
                 for n in fn.arg_names}
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    compiled = triton.compile(ASTSource(fn, signature, constexprs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm["cubin"], f"{spec.kernel}: no cubin for sm_{arch}"
    for text in spec.ptx_forbids:
        assert text not in compiled.asm["ptx"], f"{spec.kernel}: PTX for sm_{arch} has {text!r}"


def _compile_or_error(job: tuple[dict, int]) -> str:
    spec, arch = AotSpec(**job[0]), job[1]
    try:
        _compile(spec, arch)
    except Exception as exc:  # report every failing config, not just the first
        return f"{spec.kernel} {spec.constexprs} sm_{arch}: {exc}"
    return ""


if __name__ == "__main__":
    jobs = [(s, arch) for s in json.loads(sys.stdin.read()) for arch in s["archs"]]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        failures = [f for f in pool.map(_compile_or_error, jobs) if f]
    print("\n\n".join(failures))
    sys.exit(1 if failures else 0)


def record_launches(monkeypatch, module, constexpr: str) -> list:
    """Patch ``module.launcher`` so that each launch also appends its ``constexpr`` keyword to the
    returned list: which variant of a kernel ran, where two compute the same result."""
    launches = []
    launcher = module.launcher

    class Recording:
        def __init__(self, kernel, x):
            self.launch = launcher(kernel, x)

        def __getitem__(self, grid):
            return lambda *a, **kw: (launches.append(kw[constexpr]), self.launch[grid](*a, **kw))

    monkeypatch.setattr(module, "launcher", Recording)
    return launches
