"""AWQ scaling: folding a scale leaves the float model and every routing decision unchanged."""

import pytest
import torch

from tests.conftest import build_random_model
from thresher.compress.awq import (
    group_error,
    group_gram,
    search_clip,
    search_scale,
)
from thresher.compress.methods.awq import merge_batches
from thresher.compress.rtn import rtn_quantize
from thresher.compress.targets import LayerParts, apply_scale, scaling_groups
from thresher.models.adapters import get_adapter
from thresher.quant.grid import GridSpec
from thresher.quant.rtn import quantize_dequantize


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "llama"])
def test_folding_scales_keeps_layer_output_and_routing(family):
    model = build_random_model(family, num_layers=1, num_key_value_heads=4)
    adapter = get_adapter(model.config)
    layer = adapter.layers(model)[0]
    hidden = torch.randn(2, 12, model.config.hidden_size)
    pos = model.model.rotary_emb(hidden, torch.arange(12).unsqueeze(0).expand(2, -1))
    before = layer(hidden, attention_mask=None, position_embeddings=pos)
    mlp_in = adapter.post_attention_norm(layer)(hidden)
    routing = adapter.route(layer, mlp_in.reshape(-1, hidden.shape[-1]), model.config) \
        if adapter.is_moe_layer(layer) else None
    groups = scaling_groups(LayerParts(adapter, layer, 0, set()))
    names = [g.name for g in groups]
    assert "layer 0 o_proj" in names  # v -> o is scaled when shapes match (no GQA here)
    gen = torch.Generator().manual_seed(1)
    for g in groups:
        apply_scale(g, torch.exp(torch.randn(g.site.columns, generator=gen)))
    after = layer(hidden, attention_mask=None, position_embeddings=pos)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    if routing is not None:
        scaled_in = adapter.post_attention_norm(layer)(hidden)
        assert not torch.allclose(scaled_in, mlp_in), "the norm absorbed the scale"
        new = adapter.route(layer, scaled_in.reshape(-1, hidden.shape[-1]), model.config)
        assert torch.equal(new.top_k_index, routing.top_k_index)
        torch.testing.assert_close(new.top_k_weights, routing.top_k_weights)


def test_grouped_query_attention_skips_the_v_to_o_group():
    model = build_random_model("qwen3_moe", num_layers=1)  # 4 heads, 2 kv heads
    adapter = get_adapter(model.config)
    groups = scaling_groups(LayerParts(adapter, adapter.layers(model)[0], 0, set()))
    assert "layer 0 o_proj" not in [g.name for g in groups]


def test_scale_search_prefers_scaling_salient_channels():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x[:, :4] *= 30  # a few channels carry large activations
    w = torch.randn(32, 64)
    spec = GridSpec(3, sym=False)
    reference = x @ w.T

    def loss(s):
        q = rtn_quantize(w * s, spec, 32).dequantize() / s
        return float((x @ q.T - reference).pow(2).mean())

    best = search_scale(x.abs().mean(0), w.abs().mean(0), loss, duo_scaling=False)
    assert best.alpha > 0
    assert best.loss < loss(torch.ones(64))
    assert best.scale[:4].mean() > best.scale[4:].mean()


@pytest.mark.parametrize("sym,group_size", [(False, 32), (True, 32), (False, -1)])
def test_candidates_are_judged_by_the_checkpoints_dequantized_matrix(sym, group_size):
    """Every candidate is judged by exactly the weights the artifact would load."""
    torch.manual_seed(0)
    w = torch.randn(24, 96) * torch.linspace(0.1, 4, 96)
    spec = GridSpec(4, sym=sym, min_zero=1)
    assert torch.equal(quantize_dequantize(w, spec, group_size),
                       rtn_quantize(w, spec, group_size).dequantize())


def test_group_error_is_the_mean_squared_change_of_each_groups_dot_products():
    """The clip search's Gram form against the definition it replaces: per (row, group), the
    mean over tokens of the squared change of the group's partial dot product."""
    torch.manual_seed(0)
    x, d = torch.randn(40, 96), torch.randn(5, 3, 32)
    direct = (x.reshape(1, 40, 3, 32) * d.reshape(5, 1, 3, 32)).sum(dim=-1).pow(2).mean(dim=1)
    torch.testing.assert_close(group_error(d, group_gram(x, 32)), direct)


def test_clip_search_never_increases_the_partial_output_error():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[:, 0] = 8  # an outlier stretches every row's range
    x = torch.randn(128, 64)
    spec = GridSpec(3, sym=False)
    max_val = search_clip(w, x, spec, 32)
    assert max_val.shape == (16, 2)
    clipped = torch.clamp(w.reshape(16, 2, 32), -max_val.unsqueeze(2), max_val.unsqueeze(2))
    q_clip = rtn_quantize(clipped.reshape(16, 64), spec, 32).dequantize()
    q_plain = rtn_quantize(w, spec, 32).dequantize()
    err = lambda q: float((x @ (q - w).T).pow(2).sum())  # noqa: E731
    assert err(q_clip) < err(q_plain)


def test_merged_batches_keep_every_token_in_order_within_the_limit():
    xs = [torch.randn(1, n, 8) for n in (5, 4, 3, 9, 2)]
    calls = merge_batches(xs, 9)
    assert [c.shape[1] for c in calls] == [9, 3, 9, 2]  # 5+4; 3 (+9 > 9); 9 alone; 2
    torch.testing.assert_close(torch.cat(calls, dim=1), torch.cat(xs, dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_only_token_wise_blocks_are_run_on_merged_batches(family):
    """The MLP (here an MoE block: router and experts) gives each token the same output whether
    its batch runs alone or merged with others; a Gated DeltaNet's state runs along the
    sequence, so its group is never merged."""
    model = build_random_model(family, num_layers=1)
    adapter = get_adapter(model.config)
    layer = adapter.layers(model)[0]
    groups = scaling_groups(LayerParts(adapter, layer, 0, set()))
    mlp = next(g for g in groups if g.name.endswith("mlp gate/up"))
    assert mlp.tokenwise and not any(g.tokenwise for g in groups if g is not mlp)
    xs = [torch.randn(1, n, model.config.hidden_size) for n in (7, 5, 6)]
    with torch.no_grad():
        alone = torch.cat([_output(mlp.block(x)).reshape(-1, x.shape[-1]) for x in xs])
        merged = torch.cat([_output(mlp.block(x)).reshape(-1, x.shape[-1])
                            for x in merge_batches(xs, 64)])
    torch.testing.assert_close(merged, alone, rtol=1e-5, atol=1e-6)


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def test_clip_search_without_tokens_keeps_the_full_range():
    """An expert no calibration token reached has nothing to fit a shrink on."""
    w = torch.randn(8, 64)
    max_val = search_clip(w, torch.zeros(0, 64), GridSpec(4, sym=False), 32)
    torch.testing.assert_close(max_val, w.abs().reshape(8, 2, 32).amax(-1), rtol=0, atol=0)
