"""The layer-wise observer against a brute-force observation of the full model."""

import pytest
import torch

from tests.conftest import build_random_model
from thresher.models import get_adapter, save_model
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.observer import observe_experts


def brute_force_statistics(model, ids):
    """Run the whole model once; at every MoE block run every expert on every token, then keep
    the routed ones. Returns per layer (count, norm_sum, gated_norm_sum)."""
    adapter = get_adapter(model.config)
    renorm, k = adapter.norm_topk_prob(model.config), adapter.top_k(model.config)
    inputs = {}
    handles = [
        adapter.mlp(layer).register_forward_pre_hook(
            lambda _m, args, i=i: inputs.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(adapter.layers(model))
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    result = {}
    for i, x in inputs.items():
        layer = adapter.layers(model)[i]
        experts = adapter.experts(layer)
        inter = experts.down_proj.shape[-1]
        gate_up = torch.einsum("eoh,th->eto", experts.gate_up_proj, x)
        out = torch.einsum("ehi,eti->eth", experts.down_proj,
                           experts.act_fn(gate_up[..., :inter]) * gate_up[..., inter:])
        norms = out.double().norm(dim=-1)  # [E, T]
        probs = torch.softmax((x @ adapter.router(layer).weight.T).float(), dim=-1)
        top = torch.topk(probs, k, dim=-1)
        gates = probs / top.values.sum(-1, keepdim=True) if renorm else probs
        routed = torch.zeros_like(probs, dtype=torch.bool).scatter(1, top.indices, True).T
        result[i] = (routed.sum(1), (norms * routed).sum(1),
                     (norms * gates.T.double() * routed).sum(1))
    return result


@pytest.mark.parametrize(("family", "overrides"), [
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen2_moe", {"norm_topk_prob": False}),
    ("mixtral", {}),  # no flag: plain softmax gate, although its forward renormalizes
])
def test_layerwise_observer_matches_brute_force_with_one_layer_resident(family, overrides,
                                                                        tmp_path):
    model = build_random_model(family, num_layers=3, **overrides)
    save_model(model, None, tmp_path)
    lw = LayerwiseModel(tmp_path)
    resident = []
    for i in range(lw.num_layers):
        lw.layer(i).mlp.register_forward_pre_hook(
            lambda _m, _a: resident.append(lw.resident_layers()))
    ids = torch.randint(0, model.config.vocab_size, (5, 12))

    stats = observe_experts(lw, ids, batch_size=2, show_progress=False)

    assert [s.layer for s in stats] == [0, 1, 2]
    assert resident and all(len(r) == 1 for r in resident), "one decoder layer resident at a time"
    assert lw.resident_layers() == []
    expected = brute_force_statistics(model, ids)
    for s in stats:
        count, norm_sum, gated = expected[s.layer]
        assert s.tokens == ids.numel()
        assert s.count.tolist() == count.tolist()
        torch.testing.assert_close(s.norm_sum, norm_sum, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s.gated_norm_sum, gated, rtol=1e-4, atol=1e-5)
