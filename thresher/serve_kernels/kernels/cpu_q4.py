"""thresher's own 4-bit CPU matmul (cpu_q4.c): integer dot products on int8 activations.

torch's ``_weight_int4pack_mm_for_cpu`` converts every 4-bit code to bf16 and multiplies in
floating point: about 16 G multiply-adds per second per core here, so a 4-bit decode step is
bound by that arithmetic, not by memory (it reads 8 GB/s per core of packed weights while the
machine moves 12-22 GB/s). llama.cpp's Q4_0 matmul instead rounds the activations to int8 per
block of 32 and multiplies on the integer units; cpu_q4.c does the same for GPTQ and AWQ weights
(asymmetric, any group of 32 or a multiple of 64), with AVX512-VNNI where the CPU has it and
AVX2 otherwise. The activation rounding adds an error of the size of bf16's (see tests).

The C file is compiled once per machine with the host's ``-march`` into the state directory
(``$THRESHER_HOME/kernels``, about a second with gcc) and loaded with ctypes. Where there is no C
compiler, no AVX2, or ``THRESHER_CPU_Q4=off``, ``library()`` is None and the engine uses torch's
kernel (cpu_int4.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from thresher.paths import state_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_q4.c")
ENV = "THRESHER_CPU_Q4"  # "off" keeps torch's int4 kernel; a -march value overrides "native"
BLOCK = 32  # activation block (one int8 scale each)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build(march: str = "native", out_dir: Path | None = None) -> Path:
    """Compile cpu_q4.c for ``march`` and return the shared library; reused when the source,
    the flags, the compiler and the CPU are the same. Raises on a compiler error."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = ["-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, version,
                                    " ".join(sorted(_cpu_flags()))]).encode()).hexdigest()[:16]
    out_dir = out_dir or state_dir() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"cpu_q4-{march}-{key}.so"
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".cpu_q4-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                              text=True)
        if proc.returncode:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


def load(path: Path) -> ctypes.CDLL:
    """The compiled library with its functions' signatures set."""
    lib = ctypes.CDLL(str(path))
    lib.thr_q4_isa.restype = ctypes.c_char_p
    lib.thr_q4_threads.restype = ctypes.c_int
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.thr_q4_matmul.argtypes = [ptr, cint, i64, i64, ptr, ptr, i64, i64, ptr, cint]
    lib.thr_q4_matmul.restype = cint
    return lib


def library() -> ctypes.CDLL | None:
    """The kernel for this machine, or None where it cannot run (the reason logged once) or
    ``THRESHER_CPU_Q4=off``; read at each call, built once per process and -march."""
    setting = os.environ.get(ENV, "native")
    return None if setting == "off" else _library(setting)


_loaded: ctypes.CDLL | None = None  # the library the packs were made for (matmul's, per call)


@functools.cache
def _library(march: str) -> ctypes.CDLL | None:
    global _loaded
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
        log.info("cpu_q4: needs an x86-64 CPU with AVX2 and FMA; using torch's int4 kernel")
        return None
    try:
        _loaded = load(build(march))
    except (RuntimeError, OSError) as e:
        log.warning("cpu_q4 unavailable (%s); using torch's int4 kernel", e)
        return None
    return _loaded


def supports(k: int, group_size: int) -> bool:
    """Whether the kernel holds a [*, k] weight with groups of ``group_size`` input rows."""
    return k % 64 == 0 and k % group_size == 0 and (group_size == 32 or group_size % 64 == 0)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the kernel's layout from codes [K, N] in 0..15: per row, chunks of 64
    codes, byte j of a chunk holding code j (low nibble) and code 32 + j (high nibble)."""
    k, n = q.shape
    chunks = q.T.to(torch.uint8).reshape(n, k // 64, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def scales_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2, groups]: per row the group scales s, then s * z, from per-group scales
    and zeros [groups, N]."""
    s, z = scales.float(), zeros.float()
    return torch.stack([s.T, (s * z).T], dim=1).contiguous()


def matmul(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor,
           group_size: int) -> torch.Tensor:
    """x [M, K] (fp32 or bf16, contiguous) @ W.T -> [M, N] in x's dtype; the weight packed by
    ``pack_codes`` once ``library()`` has loaded."""
    lib = _loaded
    assert lib is not None, "cpu_q4 is not loaded: pack weights after library() returned it"
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    if lib.thr_q4_matmul(x.data_ptr(), bf16, m, k, weight.data_ptr(), sz.data_ptr(), n,
                         group_size, y.data_ptr(), bf16):
        raise MemoryError("cpu_q4: out of memory for the activation buffers")
    return y
