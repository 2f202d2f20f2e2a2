"""thresher's 4-bit and 8-bit CPU kernels (cpu_q4.c) against a float reference, in both builds.

The reference is the same product with the activations rounded as the kernel rounds them (int8
per block of 32, scale max|x| / 127): against it only the float summation order differs, so the
tolerance is tight (1e-5 relative). A separate check bounds the rounding itself against the exact
float product. The AVX2 build is compiled for Haswell and runs on any AVX512 machine too, so both
code paths are tested here.
"""

from __future__ import annotations

import os

import pytest
import torch

from thresher.serve_kernels.kernels import cpu_blocked, cpu_native, cpu_q4

pytestmark = pytest.mark.skipif(cpu_q4.library() is None,
                                reason="cpu_q4 does not build here (no cc, or no AVX2)")


@pytest.fixture(scope="module", params=["native", "haswell"])
def lib(request, tmp_path_factory):
    """The host build (AVX512-VNNI where the CPU has it) and the AVX2-only build."""
    if request.param == "native":
        return cpu_q4.library()
    lib = cpu_native.load(cpu_native.build("haswell", tmp_path_factory.mktemp("q4")))
    assert lib.thr_q4_isa() == b"avx2"
    return lib


def _weight(k: int, n: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    s = torch.rand(k // g, n, generator=gen) * 0.02 + 1e-3
    z = torch.randint(0, 16, (k // g, n), generator=gen).float()
    return q, s, z


def _run(lib, x, w, sz, g, out_dtype=None):
    m, k = x.shape
    y = torch.empty(m, w.shape[0], dtype=out_dtype or x.dtype)
    rc = lib.thr_q4_matmul(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, w.data_ptr(),
                           sz.data_ptr(), w.shape[0], g, y.data_ptr(),
                           int(y.dtype == torch.bfloat16))
    assert rc == 0
    return y


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 codes times a scale per block of 32."""
    blocks = x.float().reshape(x.shape[0], -1, cpu_q4.BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)  # as the kernel: x * (1 / d)
    q = torch.round(blocks * inv)
    return (q * d).reshape(x.shape)


def _reference(x, q, s, z, g):
    gi = torch.arange(q.shape[0]) // g
    w = (q.double() - z.double()[gi]) * s.double()[gi]
    return _rounded(x).double() @ w


@pytest.mark.parametrize(("k", "n", "g"), [(64, 5, 64), (256, 80, 32), (256, 83, 128),
                                           (512, 40, 512), (1024, 33, 256), (384, 16, 64),
                                           (1024, 531, 128)])
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_rounded_reference(lib, k, n, g, m, dtype):
    """Every group layout the kernel takes, row counts that leave a partial block of 4 rows,
    one and several activation rows, fp32 and bf16 in and out; 531 rows split over the threads
    even for one activation row (each thread's rows in groups, one last group of the rest)."""
    q, s, z = _weight(k, n, g)
    x = torch.randn(m, k).to(dtype)
    y = _run(lib, x, cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z), g)
    ref = _reference(x, q, s, z, g)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8  # the bf16 output's own rounding
    assert y.dtype == dtype
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_batch(lib, g, dtype):
    """A row alone, in a few rows (the direct path for groups of 128k) and in many (AVX-512:
    weights unpacked first) gets the same bits: a speculative verify chunk's tokens, batched,
    compute what their single decode steps would."""
    q, s, z = _weight(512, 40, g)
    w, sz = cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z)
    rows = torch.randn(33, 512).to(dtype)
    alone = _run(lib, rows[-1:].contiguous(), w, sz, g)
    for m in (2, 5, 16, 17, 33):
        assert torch.equal(_run(lib, rows[-m:].contiguous(), w, sz, g)[-1:], alone), m


def _run8(lib, x, codes, sz, g):
    m, k = x.shape
    y = torch.empty(m, codes.shape[0], dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    rc = lib.thr_q8_matmul(x.data_ptr(), bf16, m, k, codes.data_ptr(), sz.data_ptr(),
                           codes.shape[0], g, y.data_ptr(), bf16)
    assert rc == 0
    return y


def _weight8(k: int, n: int, g: int):
    """8-bit codes, scales and zeros [K, N] (the reference's layout) and the kernel's [N, K]
    codes and [N, 2, groups] scales."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 256, (k, n), generator=gen)
    s = torch.rand(k // g, n, generator=gen) * 0.002 + 1e-4
    z = torch.randint(100, 156, (k // g, n), generator=gen).float()
    return q, s, z, q.T.to(torch.uint8).contiguous(), cpu_q4.scales_zeros(s, z)


@pytest.mark.parametrize(("k", "n", "g"), [(64, 5, 64), (256, 80, 32), (256, 83, 128),
                                           (512, 40, 512), (1024, 33, 256), (1024, 531, 128)])
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_matches_the_rounded_reference(lib, k, n, g, m, dtype):
    """thr_q8_matmul (codes 0-255, a byte each; groups of 32, of 64k, one per row): the 4-bit
    kernel's reference with 8-bit codes, whose pair sums pass the AVX2 path's int16 saturation
    unless widened."""
    q, s, z, codes, sz = _weight8(k, n, g)
    x = torch.randn(m, k).to(dtype)
    y = _run8(lib, x, codes, sz, g)
    ref = _reference(x, q, s, z, g)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("g", [32, 128])
def test_8bit_rows_do_not_depend_on_the_batch_and_odd_shapes_are_refused(lib, g):
    q, s, z, codes, sz = _weight8(512, 40, g)
    rows = torch.randn(17, 512)
    alone = _run8(lib, rows[-1:].contiguous(), codes, sz, g)
    for m in (2, 5, 17):
        assert torch.equal(_run8(lib, rows[-m:].contiguous(), codes, sz, g)[-1:], alone), m
    y = torch.empty(1, 40)
    for k, g_bad in ((512, 96), (480, 32)):  # a group of 96; K not a multiple of 64
        assert lib.thr_q8_matmul(rows.data_ptr(), 0, 1, k, codes.data_ptr(), sz.data_ptr(), 40,
                                 g_bad, y.data_ptr(), 0) == -2


def _dequant(lib, codes, sz, k, g, bits):
    w = torch.empty(codes.shape[0], k, dtype=torch.bfloat16)
    assert lib.thr_q_dequant(codes.data_ptr(), bits, sz.data_ptr(), codes.shape[0], k, g,
                             w.data_ptr()) == 0
    return w


@pytest.mark.parametrize(("k", "n", "g"), [(64, 5, 64), (256, 80, 32), (256, 83, 128),
                                           (512, 40, 512), (1024, 33, 256)])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_is_the_weight_rounded_once_to_bf16(lib, k, n, g, bits):
    """thr_q_dequant (a prefill's weight): q * s - s * z in fp32, rounded to bf16 as torch
    rounds, for both code layouts and every group layout the matmuls take."""
    if bits == 4:
        q, s, z = _weight(k, n, g)
        codes, sz = cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z)
    else:
        q, s, z, codes, sz = _weight8(k, n, g)
    gi = torch.arange(k) // g
    want = (q.T.float() * sz[:, 0][:, gi] - sz[:, 1][:, gi]).bfloat16()
    assert torch.equal(_dequant(lib, codes, sz, k, g, bits), want)
    assert lib.thr_q_dequant(codes.data_ptr(), bits, sz.data_ptr(), n, k, 96, want.data_ptr()) == -2


@pytest.mark.parametrize("m", [cpu_q4.DEQUANT_ROWS - 1, cpu_q4.DEQUANT_ROWS, 70])
def test_prefill_rows_take_the_dequantized_weight_where_matmuls_have_amx(m):
    """From DEQUANT_ROWS bf16 rows on (and AMX tiles for torch's matmul), matmul is the bf16
    product with the dequantized weight; below, or without the tiles, the integer kernel's. Both
    stay within bf16 rounding of the exact product."""
    k, n, g = 512, 72, 128
    q, s, z = _weight(k, n, g)
    codes, sz = cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z)
    x = torch.randn(m, k).bfloat16()
    y = cpu_q4.matmul(x, codes, sz, g)
    if m >= cpu_q4.DEQUANT_ROWS and cpu_blocked.amx_matmul():  # rows padded as a prefill's
        padded = cpu_blocked.pad_rows(x)  # (oneDNN's sums at 70 and 96 rows may part in a bit)
        assert torch.equal(y, (padded @ cpu_q4.dequantize(codes, sz, k, g).T)[:m])
    else:
        assert torch.equal(y, _run(cpu_q4.library(), x, codes, sz, g))
    gi = torch.arange(k) // g
    exact = x.double() @ ((q.double() - z.double()[gi]) * s.double()[gi])
    assert ((y.double() - exact).norm() / exact.norm()).item() < 2 ** -7
    y8 = cpu_q4.matmul8(x, *_weight8(k, n, g)[3:], g)  # the 8-bit codes take the same path
    q8, s8, z8 = _weight8(k, n, g)[:3]
    exact8 = x.double() @ ((q8.double() - z8.double()[gi]) * s8.double()[gi])
    assert ((y8.double() - exact8).norm() / exact8.norm()).item() < 2 ** -7


@pytest.mark.skipif(not cpu_blocked.amx_matmul(), reason="torch's bf16 matmul has no AMX tiles here")
def test_a_large_prefill_weight_is_dequantized_in_bounded_slices(monkeypatch):
    """A weight over SCRATCH_WEIGHTS goes in slices of output rows (the last one short) through
    a buffer of at most that size, with the unsliced product's values."""
    k, n, g = 256, 80, 32
    q, s, z = _weight(k, n, g)
    codes, sz = cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z)
    x = torch.randn(cpu_q4.DEQUANT_ROWS + 3, k).bfloat16()
    whole = x @ cpu_q4.dequantize(codes, sz, k, g).T
    monkeypatch.setattr(cpu_blocked, "SCRATCH_WEIGHTS", 24 * k)  # slices of 24 rows: 24, 24, 24, 8
    monkeypatch.setattr(cpu_blocked._scratch, "buffers", {}, raising=False)
    y = cpu_q4.matmul(x, codes, sz, g)
    assert cpu_blocked._scratch.buffers[torch.bfloat16].numel() == 24 * k
    assert torch.allclose(y.float(), whole.float(), rtol=2 ** -7, atol=1e-3)


def test_bf16_output_is_the_fp32_output_rounded(lib):
    """Same activations (bf16 values) in both dtypes give the same sums; the bf16 output is the
    fp32 one rounded to nearest even."""
    q, s, z = _weight(512, 64, 128)
    x = torch.randn(4, 512).bfloat16()
    w, sz = cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z)
    y32 = _run(lib, x.float(), w, sz, 128)
    y16 = _run(lib, x, w, sz, 128)
    assert torch.equal(y16, y32.bfloat16())


def test_rounding_error_is_bounded_against_the_exact_product(lib):
    """The int8 activations cost about 0.5% of the output's norm on Gaussian activations, the
    size of bf16's rounding; a scale or zero misplaced by one group would cost 10% or more."""
    q, s, z = _weight(2048, 256, 128)
    x = torch.randn(8, 2048)
    gi = torch.arange(2048) // 128
    exact = x.double() @ ((q.double() - z.double()[gi]) * s.double()[gi])
    y = _run(lib, x, cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z), 128)
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_zero_activations_and_zero_blocks(lib):
    """A block of zeros has scale 0 and must not divide by it."""
    q, s, z = _weight(128, 8, 64)
    x = torch.randn(2, 128)
    x[0] = 0
    x[1, :32] = 0
    y = _run(lib, x, cpu_q4.pack_codes(q), cpu_q4.scales_zeros(s, z), 64)
    assert torch.isfinite(y).all() and torch.equal(y[0], torch.zeros(8))
    assert torch.allclose(y[1].double(), _reference(x, q, s, z, 64)[1], rtol=1e-5, atol=1e-6)


def test_threads_follow_torch():
    """The kernel's OpenMP runtime is torch's: set_num_threads reaches it."""
    lib = cpu_q4.library()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert lib.thr_q4_threads() == 1
        torch.set_num_threads(2)
        assert lib.thr_q4_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_layout_limits():
    assert cpu_q4.supports(1024, 128) and cpu_q4.supports(1024, 32) and cpu_q4.supports(64, 64)
    assert not cpu_q4.supports(96, 32)  # K not a multiple of 64
    assert not cpu_q4.supports(1024, 16) and not cpu_q4.supports(960, 96)


def test_a_compiler_error_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="compiling cpu_q4.c cpu_nf4.c cpu_norm.c cpu_attention.c cpu_step.c failed"):
        cpu_native.build("native", tmp_path)
    assert not list(tmp_path.glob("*.so"))  # nothing half-written left to load


def test_a_library_others_could_write_is_rebuilt_privately(tmp_path, caplog):
    """A file of the expected name that another user could have written (here: group- and
    world-writable, holding garbage) is not loaded: the library is built again in a private
    directory, with a warning."""
    built = cpu_native.build("haswell", tmp_path)
    built.write_bytes(b"not a library")
    built.chmod(0o666)
    with caplog.at_level("WARNING", logger="thresher.paths"):
        rebuilt = cpu_native.build("haswell", tmp_path)
    assert rebuilt != built and rebuilt.name == built.name
    assert rebuilt.parent.stat().st_mode & 0o777 == 0o700
    assert cpu_native.load(rebuilt).thr_q4_isa() == b"avx2"
    assert str(built) in caplog.text and "not private" in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user's needs root")
def test_a_library_owned_by_another_user_is_not_loaded(tmp_path):
    built = cpu_native.build("haswell", tmp_path)
    os.chown(built, 65534, 65534)  # nobody
    assert cpu_native.build("haswell", tmp_path) != built


def test_a_compile_error_fails_loudly_when_the_kernels_are_required(monkeypatch, caplog):
    """For users a compiler error is a warning with the compiler's message and torch's operators;
    with THRESHER_REQUIRE_C_KERNELS=1 (the suite's setting) it raises; no compiler is not an
    error either way."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv(cpu_native.REQUIRE_ENV, "1")
    with pytest.raises(RuntimeError, match="compiling cpu_q4.c"):
        cpu_native._library.__wrapped__("native")
    monkeypatch.setenv(cpu_native.REQUIRE_ENV, "0")
    with caplog.at_level("WARNING", logger=cpu_native.__name__):
        assert cpu_native._library.__wrapped__("native") is None
    assert "compiling cpu_q4.c" in caplog.text
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv(cpu_native.REQUIRE_ENV, "1")
    assert cpu_native._library.__wrapped__("native") is None
