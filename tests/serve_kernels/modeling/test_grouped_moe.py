"""The CPU grouped expert loop: a single token (decode at batch 1) skips the sort by expert and
must give what the sorted path and the per-expert reference give."""

from __future__ import annotations

import torch

from thresher.serve_kernels.kernels.moe import ExpertWeights, fused_moe_ref
from thresher.serve_kernels.modeling.moe import _combine, _sort_by_expert, grouped_moe_torch

E, TOP_K, H, INTER = 8, 2, 64, 96


def test_one_token_keeps_slot_order_and_combines_as_the_sorted_order():
    ids, weights = torch.tensor([[5, 2]]), torch.tensor([[0.7, 0.3]]).to(torch.bfloat16)
    order, spans = _sort_by_expert(ids, E)
    assert order is None and spans == [(5, 0, 1), (2, 1, 2)]
    out = torch.randn(TOP_K, H).to(torch.bfloat16)  # expert outputs in slot order
    by_expert = ids.flatten().argsort(stable=True)
    assert torch.equal(_combine(out, None, weights, torch.bfloat16),
                       _combine(out[by_expert], by_expert, weights, torch.bfloat16))


def test_one_token_matches_its_row_of_a_batch_and_the_reference():
    gen = torch.Generator().manual_seed(0)
    gate_up = ExpertWeights("dense", torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5)
    down = ExpertWeights("dense", torch.randn(E, H, INTER, generator=gen) / INTER**0.5)
    x = torch.randn(5, H, generator=gen)
    weights, ids = torch.randn(5, E, generator=gen).softmax(-1).topk(TOP_K, dim=-1)
    batch = grouped_moe_torch(x, gate_up, down, weights, ids)
    for t in range(5):
        one = grouped_moe_torch(x[t : t + 1], gate_up, down, weights[t : t + 1], ids[t : t + 1])
        assert torch.allclose(one, batch[t : t + 1], atol=1e-5)
        ref = fused_moe_ref(x[t : t + 1], gate_up, down, weights[t : t + 1], ids[t : t + 1])
        assert torch.allclose(one, ref, atol=1e-5)
