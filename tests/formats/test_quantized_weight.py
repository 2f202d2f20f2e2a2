"""QuantizedWeight.dequantize: contiguous groups take a broadcast, any g_idx the gather."""

import pytest
import torch

from thresher.formats.quantized import QuantizedWeight


def _weight(rows: int, cols: int, group_size: int, g_idx: torch.Tensor) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(0)
    groups = 1 if group_size == -1 else cols // group_size
    return QuantizedWeight(
        codes=torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8),
        scales=torch.rand(rows, groups, generator=gen).half().float(),
        zeros=torch.randint(1, 16, (rows, groups), generator=gen, dtype=torch.int32),
        g_idx=g_idx.to(torch.int32), bits=4, group_size=group_size)


def _gathered(q: QuantizedWeight) -> torch.Tensor:
    g = q.g_idx.long()
    return q.scales[:, g] * (q.codes.float() - q.zeros[:, g].float())


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_contiguous_groups_dequantize_to_the_gathered_values(group_size):
    cols = 256
    gs = cols if group_size == -1 else group_size
    q = _weight(12, cols, group_size, torch.arange(cols) // gs)
    assert torch.equal(q.dequantize(), _gathered(q))


def test_act_order_groups_are_gathered():
    cols, gs = 256, 32
    g_idx = (torch.randperm(cols, generator=torch.Generator().manual_seed(1)) // gs)
    q = _weight(12, cols, gs, g_idx)
    assert torch.equal(q.dequantize(), _gathered(q))
    contiguous = _weight(12, cols, gs, torch.arange(cols) // gs)
    assert not torch.equal(q.dequantize(), contiguous.dequantize())  # g_idx is honoured
