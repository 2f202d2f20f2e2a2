"""thresher's C kernels for the CPU (``cpu_q4.c``, ``cpu_nf4.c``, ``cpu_norm.c``,
``cpu_attention.c``, ``cpu_step.c``): built once per machine.

A decode step on a CPU is a few hundred small operations; where torch's take tens of
microseconds for a [1, 1024] row (its bf16 RMSNorm is half a dozen dispatched operators) or are
bound by arithmetic (its int4 matmul), a C function called through ctypes takes a few. The C
files are compiled together with the host's ``-march`` into the state directory
(``$THRESHER_HOME/kernels``, about a second with gcc) and loaded with ctypes; their OpenMP
threads are torch's (the libgomp torch loaded is the one the library binds to). A library there
is loaded only if it is the current user's and nobody else can write to it (``paths.is_private``);
otherwise it is rebuilt in a private directory.

Where there is no C compiler, the CPU is not x86-64 with AVX2 and FMA, or ``THRESHER_CPU_NATIVE=off``,
``library()`` is None and the engine keeps torch's operators (``cpu_int4``, ``norm``). A compiler
error does the same, with a warning that carries the compiler's message, so that a user's server
still starts; with ``THRESHER_REQUIRE_C_KERNELS=1`` (the test suite sets it) it raises instead.
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

import torch  # noqa: F401  # loaded before any library here, so they bind to its libgomp

from thresher.paths import code_dir, fallback_code_dir, is_private

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("cpu_q4.c", "cpu_nf4.c", "cpu_norm.c", "cpu_attention.c", "cpu_step.c"))
HEADERS = (Path(__file__).with_name("cpu_common.h"),)  # included by the sources
ENV = "THRESHER_CPU_NATIVE"  # "off" keeps torch's operators; a -march value overrides "native"
REQUIRE_ENV = "THRESHER_REQUIRE_C_KERNELS"  # "1": a build failure raises instead of falling back


class NoCompilerError(RuntimeError):
    """No C compiler on this machine: the one build failure that is never an error."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build(march: str = "native", out_dir: Path | None = None) -> Path:
    """Compile the C files for ``march`` and return the shared library; reused when the sources,
    the flags, the compiler and the CPU are the same and the file is private. Raises on a compiler
    error, with the compiler's message."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NoCompilerError("no C compiler (cc or gcc) on PATH")
    # no contraction of a * b + c into fma: plain C sums round as torch's elementwise ops do
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
             "-std=c11"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    text = [src.read_text() for src in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*text, *flags, version,
                                    " ".join(sorted(_cpu_flags()))]).encode()).hexdigest()[:16]
    out_dir = out_dir or code_dir("kernels")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"thresher_cpu-{march}-{key}.so"
    if lib.exists() and not is_private(lib):
        lib = fallback_code_dir("kernels", lib) / lib.name
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".thresher_cpu-", suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
                              capture_output=True, text=True)
        if proc.returncode:
            names = " ".join(src.name for src in SOURCES)
            raise RuntimeError(f"compiling {names} failed:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)  # the linker's mode follows the umask, which may let the group write
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
    lib.thr_q8_matmul.argtypes = [ptr, cint, i64, i64, ptr, ptr, i64, i64, ptr, cint]
    lib.thr_q8_matmul.restype = cint
    lib.thr_q_dequant.argtypes = [ptr, cint, ptr, i64, i64, i64, ptr]
    lib.thr_q_dequant.restype = cint
    lib.thr_rms_norm.argtypes = [ptr, ptr, ptr, ptr, cint, i64, ptr, i64, i64, ctypes.c_float,
                                 cint]
    lib.thr_rms_norm.restype = None
    lib.thr_q4_moe_one.argtypes = [ptr, cint, ptr, cint, ptr, i64, i64, i64, i64, ptr, ptr, i64,
                                   ptr, ptr, i64, ptr]
    lib.thr_q4_moe_one.restype = cint
    lib.thr_paged_decode.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                                     ctypes.c_float, ptr, cint]
    lib.thr_paged_decode.restype = cint
    lib.thr_paged_decode_sinks.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                                           ctypes.c_float, ptr, i64, ptr, cint]
    lib.thr_paged_decode_sinks.restype = cint
    lib.thr_dense_isa.restype = ctypes.c_char_p
    lib.thr_dense_matmul.argtypes = [ptr, i64, i64, ptr, cint, i64, ptr]
    lib.thr_dense_matmul.restype = cint
    lib.thr_nf4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.thr_nf4_matmul.restype = cint
    lib.thr_nf4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, cint]
    lib.thr_nf4_dequant.restype = cint
    lib.thr_amx.argtypes = [cint]
    lib.thr_amx.restype = cint
    lib.thr_decode_step.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
    lib.thr_decode_step.restype = cint
    lib.thr_lm_head.argtypes = [ptr, ptr, i64, ptr]
    lib.thr_lm_head.restype = cint
    return lib


def library() -> ctypes.CDLL | None:
    """The kernels for this machine, or None where it cannot run (the reason logged once) or
    ``THRESHER_CPU_NATIVE=off``; read at each call, built once per process and -march."""
    setting = os.environ.get(ENV, "native")
    return None if setting == "off" else _library(setting)


_loaded: ctypes.CDLL | None = None  # the library the engine's layers were set up for


@functools.cache
def _library(march: str) -> ctypes.CDLL | None:
    global _loaded
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
        log.info("thresher's C kernels need an x86-64 CPU with AVX2 and FMA; using torch's")
        return None
    try:
        _loaded = load(build(march))
    except NoCompilerError as e:
        log.info("thresher's C kernels need a C compiler (%s); using torch's", e)
        return None
    except (RuntimeError, OSError) as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            raise
        log.warning("thresher's C kernels unavailable (%s); using torch's", e)
        return None
    return _loaded


def bf16_dot() -> bool:
    """True when the C kernels here multiply bf16 weights with the CPU's bf16 dot-product
    instructions (AVX512-BF16), as the C decode step's dense matmuls then do."""
    lib = library()
    return lib is not None and lib.thr_dense_isa().decode().endswith("+bf16")


def loaded() -> ctypes.CDLL | None:
    """The library ``library()`` last loaded, without reading the environment: what calls on
    weights already converted for it use."""
    return _loaded
