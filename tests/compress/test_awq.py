"""AWQ scaling: folding a scale leaves the float model and every routing decision unchanged."""

import pytest
import torch

from tests.conftest import build_random_model
from thresher.compress.awq import _partial_products, search_clip, search_scale
from thresher.compress.rtn import rtn_quantize
from thresher.compress.targets import LayerParts, apply_scale, scaling_groups
from thresher.models.adapters import get_adapter
from thresher.quant.grid import GridSpec


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


def test_partial_products_are_each_groups_dot_products():
    """The clip search's batched matmul against the definition it replaces: sum over a group's
    columns of token times weight, per (row, token, group)."""
    torch.manual_seed(0)
    xg, wg = torch.randn(1, 40, 3, 32), torch.randn(5, 1, 3, 32)
    torch.testing.assert_close(_partial_products(xg, wg), (xg * wg).sum(dim=-1))


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
