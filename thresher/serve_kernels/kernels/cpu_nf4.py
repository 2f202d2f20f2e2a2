"""NF4 matmuls on the CPU through bitsandbytes' native NF4 gemv (AVX512-BF16 CPUs), for the
operator path: prefill, and decode where the one-call step is off. The step's decode runs NF4 on
thresher's own kernel (``cpu_nf4.c``), from the published codes.

The dequantizing reference rebuilds the whole fp32 matrix on every call. bitsandbytes ships a CPU
kernel that reads NF4 codes directly (``gemv_4bit``), but only from its own CPU layout: the codes
regrouped in blocks of 32 output rows and the absmax transposed to bf16 [K / blocksize, N].
bitsandbytes does that repacking in a private helper (``_convert_weight_packed_for_cpu``), called
here once per layer at load time; without it the kernel's result is wrong. The kernel needs N a
multiple of 32 and whole blocks per row (K a multiple of the blocksize); other layers keep the
reference.

The kernel runs in bf16 (activations and absmax rounded to bf16) and its time grows with the
number of rows like a loop of matvecs: up to 16-64 rows it beats dequantize-then-matmul clearly,
from 256 rows the bf16 matrix dequantized by bitsandbytes' native routine plus one dense matmul
is faster (``benchmarks/engine/cpu_nf4.py``, docs/benchmarks.md; at 128 it went both ways), so calls with
``DEQUANTIZE_ROWS`` rows or more take that; where torch's bf16 matmul has AMX tiles, from 32 rows
(64 for matrices over 4M weights), their row counts bucketed as ``cpu_blocked.pad_rows`` says.
Where ``cpu_native`` built thresher's C kernels, the dequantizing is their pass instead
(``thr_nf4_dequant``: the bits of bitsandbytes' ``dequantize_4bit``, 2x its speed on 4M weights
and 8x on 16M, into a reused buffer), which moves the switch to 16 rows with AMX and 64 without
(``dequantize_rows``).

The kernel exists only on CPUs with AVX512-BF16 (bitsandbytes registers it only there); elsewhere
``cpu_nf4_available`` is False and NF4 layers run the dequantizing reference's fp32 arithmetic
with W rebuilt by the C pass into a reused buffer (``nf4_fp32_matmul``), or, without thresher's
C kernels, the reference itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from thresher.formats.nf4 import NF4Weight, bitsandbytes_functional
from thresher.serve_kernels.kernels.cpu_blocked import amx_matmul, dequantized_matmul, pad_rows
from thresher.serve_kernels.kernels.cpu_native import loaded

DEQUANTIZE_ROWS = 256  # from this many rows on, dequantize to bf16 and run one dense matmul
# Where torch's bf16 matmul has AMX tiles (benchmarks/engine/cpu_nf4.py, one and two threads):
# up to 4M weights dequantizing won from 32 rows (1.9-2.1x the gemv; 0.9-1.1x at 16), larger
# matrices from 48-64 (bitsandbytes' dequantization of 16M weights takes 11-17 ms, most of it
# the new tensor's first touch): 4096 x 4096 at 32 rows 0.59-0.80x, at 64 1.08-1.50x
DEQUANTIZE_AMX_ROWS = 32
DEQUANTIZE_AMX_ROWS_LARGE, LARGE_WEIGHTS = 64, 1 << 22
# With thresher's dequantizing pass (same table, its "thresher dequantize" column): with AMX it
# won from 12-16 rows at every shape (1.5-1.7x the gemv at 16, 0.8x at 8); with oneDNN held to
# AVX512-BF16 from 64 (1.12-1.13x; 0.92-0.96x at 32)
OWN_DEQUANTIZE_AMX_ROWS, OWN_DEQUANTIZE_ROWS = 16, 64
BLOCK_N = 32  # output rows per block of bitsandbytes' CPU layout


@functools.cache
def cpu_nf4_available() -> bool:
    """True when this CPU and bitsandbytes build have the native NF4 gemv: bitsandbytes registers
    its CPU ``gemv_4bit`` only where its own probe, ``has_avx512bf16()``, says AVX512-BF16 (torch's
    ``get_cpu_capability()`` says AVX512 without telling whether BF16 is there)."""
    try:
        return bool(bitsandbytes_functional().has_avx512bf16())
    except ImportError:
        return False


@dataclass
class NF4Pack:
    """One NF4 weight [N, K] in bitsandbytes' CPU layout, plus what dequantizing it takes."""

    weight: torch.Tensor  # uint8 [N, K/2], regrouped for the gemv kernel
    state: Any  # bitsandbytes QuantState: bf16 absmax [K/blocksize, N], non-nested
    dense_state: Any  # QuantState of the published bytes with fp32 absmax, dequantizing to bf16
    published: torch.Tensor  # the published packed bytes (shared with the layer, not a copy)
    absmax: torch.Tensor  # fp32 [N, K / blocksize], double quantization undone
    quant_map: torch.Tensor  # fp32 [16]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads: the regrouped codes and the bf16 absmax."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.state.absmax))


def _convert_for_cpu(packed: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
    """bitsandbytes' private repacking for its CPU kernel (``functional.py``,
    ``_convert_weight_packed_for_cpu(qweight, quant_state, block_n=32)``, bitsandbytes 0.50):
    returns the regrouped codes and mutates ``state`` (absmax made fp32, transposed, bf16;
    nested flag cleared; ``packing_format_for_cpu`` set). The one place thresher calls it."""
    return bitsandbytes_functional()._convert_weight_packed_for_cpu(packed, state, block_n=BLOCK_N)


def pack_nf4_cpu(weight: NF4Weight) -> NF4Pack | None:
    """``weight`` in the CPU kernel's layout, or None when the kernel is missing or cannot hold it
    (N not a multiple of 32, blocks straddling rows)."""
    n, k = weight.shape
    if not cpu_nf4_available() or n % BLOCK_N or k % weight.blocksize or k % 2:
        return None
    absmax = weight.absmax_fp32().float().contiguous()
    plain = NF4Weight(weight.packed, absmax, weight.quant_map.float(), weight.shape,
                      weight.blocksize, dtype=torch.bfloat16)
    packed, state = _convert_for_cpu(weight.packed.reshape(-1), plain.state)
    return NF4Pack(packed.contiguous(), state, plain.state, weight.packed,
                   absmax.view(n, k // weight.blocksize), plain.quant_map.contiguous())


def dequantize_rows(weights: int) -> int:
    """Rows from which a call with a matrix of ``weights`` dequantizes it (constants above)."""
    if loaded() is not None:
        return OWN_DEQUANTIZE_AMX_ROWS if amx_matmul() else OWN_DEQUANTIZE_ROWS
    if not amx_matmul():
        return DEQUANTIZE_ROWS
    return DEQUANTIZE_AMX_ROWS if weights <= LARGE_WEIGHTS else DEQUANTIZE_AMX_ROWS_LARGE


def _dequantize(codes: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, n0: int,
                n1: int, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows n0:n1 of the W that ``codes`` (uint8, N * K / 2 as published), ``absmax`` (fp32
    [N, K / blocksize]) and ``quant_map`` (fp32 [16]) hold, in ``dtype`` (bf16 or fp32), on
    thresher's C pass, into ``out`` if given."""
    lib = loaded()
    assert lib is not None, "thr_nf4_dequant needs thresher's C kernels (cpu_native.library())"
    n, blocks = absmax.shape
    k = codes.numel() * 2 // n
    w = torch.empty((n1 - n0) * k, dtype=dtype) if out is None else out
    w = w[: (n1 - n0) * k].view(n1 - n0, k)
    rows = codes.reshape(n, k // 2)[n0:n1]
    rc = lib.thr_nf4_dequant(rows.data_ptr(), absmax[n0:n1].data_ptr(), quant_map.data_ptr(),
                             k // blocks, n1 - n0, k, w.data_ptr(), int(dtype == torch.bfloat16))
    if rc:
        raise ValueError(f"NF4 block size {k // blocks} must be a multiple of 32 dividing {k}")
    return w


def dequantize(pack: NF4Pack, n0: int = 0, n1: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W's rows n0:n1 [n1 - n0, K] in bf16 (map[code] * absmax in fp32, rounded once: the bits
    of bitsandbytes' ``dequantize_4bit``) on thresher's C pass, into ``out`` if given."""
    n1 = pack.out_features if n1 is None else n1
    return _dequantize(pack.published, pack.absmax, pack.quant_map, n0, n1, out, torch.bfloat16)


def nf4_fp32_holds(weight: NF4Weight) -> bool:
    """Whether ``nf4_fp32_matmul`` takes ``weight``: thresher's C kernels built, whole blocks of a
    multiple of 32 codes per row, the absmax fp32 (double quantization undone)."""
    n, k = weight.shape
    return (loaded() is not None and weight.nested_absmax is None and weight.blocksize % 32 == 0
            and k % weight.blocksize == 0 and weight.absmax.dtype == torch.float32
            and weight.absmax.is_contiguous() and weight.packed.is_contiguous())


def nf4_fp32_matmul(x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
    """x @ W.T in fp32, returned in x's dtype: the dequantizing reference's arithmetic
    (``kernels.nf4.nf4_matmul_ref``), with W rebuilt by thresher's C pass into a reused buffer.
    The operator path's NF4 where bitsandbytes has no CPU kernel (CPUs without AVX512-BF16),
    where the reference took 13 ms for a 4096 x 1024 matvec."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).float()
    absmax = weight.absmax.view(n, k // weight.blocksize)
    quant_map = weight.quant_map.float().contiguous()
    y = dequantized_matmul(x2, n, lambda n0, n1, buf: _dequantize(
        weight.packed, absmax, quant_map, n0, n1, buf, torch.float32))
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def nf4_cpu_matmul(x: torch.Tensor, pack: NF4Pack) -> torch.Tensor:
    """x @ W.T for x [..., K] on the CPU kernel (bf16 inside), returned in x's dtype."""
    bnbf = bitsandbytes_functional()
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    m = x2.shape[0]
    if m >= dequantize_rows(pack.out_features * x2.shape[1]):
        if loaded() is not None:
            y = dequantized_matmul(x2, pack.out_features,
                                   lambda n0, n1, buf: dequantize(pack, n0, n1, buf))
        else:  # rows bucketed for oneDNN
            y = (pad_rows(x2) @ bnbf.dequantize_4bit(pack.published, pack.dense_state).T)[:m]
    else:
        y = bnbf.gemv_4bit(x2, pack.weight, state=pack.state)
    return y.to(x.dtype).reshape(*x.shape[:-1], pack.out_features)
