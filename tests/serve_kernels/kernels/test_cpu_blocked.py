"""16-bit matrices in oneDNN's blocked layout: a prefill's row counts bucketed, products kept."""

from __future__ import annotations

import pytest
import torch

from thresher.serve_kernels.kernels import cpu_blocked

pytestmark = pytest.mark.skipif(not cpu_blocked.blocked_supported(torch.bfloat16),
                                reason="this CPU's oneDNN does not run bf16")


@pytest.mark.parametrize("m", [1, 31, 32, 33, 70, 96])
def test_pad_rows_buckets_a_prefills_rows_with_zeros(m):
    x = torch.randn(m, 48).bfloat16()
    padded = cpu_blocked.pad_rows(x)
    if m < cpu_blocked.ROW_BUCKET or m % cpu_blocked.ROW_BUCKET == 0:
        assert padded is x
    else:
        assert padded.shape == (-(-m // cpu_blocked.ROW_BUCKET) * cpu_blocked.ROW_BUCKET, 48)
        assert torch.equal(padded[:m], x) and not padded[m:].any()
    short = cpu_blocked.pad_rows(x, short=True)  # a dequantized weight's call: fewer rows too
    assert short.shape == (-(-m // cpu_blocked.ROW_BUCKET) * cpu_blocked.ROW_BUCKET, 48)
    assert torch.equal(short[:m], x) and not short[m:].any()


@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (33, 256), (2, 35, 256)])
def test_blocked_matmul_keeps_the_rows_and_their_products(shape):
    """Any leading shape, padded or not: the product of each row with the weight (+ bias), to
    bf16 rounding of the plain matmul."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(*shape, generator=gen).bfloat16()
    y = cpu_blocked.blocked_matmul(x, cpu_blocked.block(w), bias)
    want = x.float() @ w.float().T + bias.float()
    assert y.shape == (*shape[:-1], 96) and y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), want, rtol=2 ** -7, atol=2e-2)
