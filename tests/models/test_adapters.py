import pytest
import torch

from tests.conftest import build_random_model, first_moe_layer
from thresher.errors import UnsupportedArchitectureError
from thresher.models import get_adapter
from thresher.models.random_init import DENSE_FAMILIES, MOE_FAMILIES


# gpt-oss's transposed, interleaved experts: tests/models/test_gpt_oss.py
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f != "gpt_oss"])
def test_moe_adapter_exposes_modules_and_expert_views(family):
    model = build_random_model(family)
    ad = get_adapter(model.config)
    assert ad.is_moe and ad.num_experts(model.config) == 8 and ad.top_k(model.config) == 2
    layer = first_moe_layer(ad, model)
    projs = ad.attention_projections(layer)
    if ad.attention_kind == "mla":
        assert set(projs) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
        assert projs["kv_b_proj"].in_features == model.config.kv_lora_rank
    elif hasattr(layer, "linear_attn"):  # Qwen3.5's Gated DeltaNet (in_proj_a/b stay 16-bit)
        assert set(projs) == {"in_proj_qkv", "in_proj_z", "out_proj"}
    else:
        assert set(projs) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert projs[next(iter(projs))].in_features == model.config.hidden_size
    assert ad.input_norm(layer).weight.shape == (model.config.hidden_size,)
    assert ad.is_moe_layer(layer)
    assert ad.router(layer).weight.shape == (8, model.config.hidden_size)
    experts = ad.experts(layer)
    inter = experts.down_proj.shape[-1]
    for e in (0, 5):
        view = ad.expert_view(layer, e)
        assert view.gate.shape == (inter, model.config.hidden_size)
        assert torch.equal(view.gate, experts.gate_up_proj[e, :inter])
        assert torch.equal(view.up, experts.gate_up_proj[e, inter:])
        assert torch.equal(view.down, experts.down_proj[e])
        # a view, not a copy: writing through it changes the model
        assert view.down.data_ptr() == experts.down_proj[e].data_ptr()
    assert (ad.shared_expert(layer) is not None) == (family in ("qwen2_moe", "glm4_moe",
                                                                 "deepseek_v3", "ernie4_5_moe",
                                                                 "qwen3_5_moe"))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_route_and_expert_forward_reproduce_the_moe_block(family):
    """Routing + per-expert outputs through the adapter == the model's own MoE forward."""
    model = build_random_model(family)
    ad = get_adapter(model.config)
    layer = first_moe_layer(ad, model)
    x = torch.randn(64, model.config.hidden_size)
    routing = ad.route(layer, x, model.config)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(routing.top_k_index.shape[1]):
            e = int(routing.top_k_index[t, j])
            out[t] += routing.top_k_weights[t, j] * ad.expert_forward(layer, e, x[t : t + 1])[0]
    shared, shared_gate = ad.shared_expert(layer), ad.shared_expert_gate(layer)
    if shared is not None:
        out += shared(x) if shared_gate is None else torch.sigmoid(shared_gate(x)) * shared(x)
    with torch.no_grad():
        ref = ad.mlp(layer)(x.unsqueeze(0))
    ref = (ref[0] if isinstance(ref, tuple) else ref)[0]  # gpt-oss also returns its gates
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_adapter(family):
    model = build_random_model(family)
    ad = get_adapter(model.config)
    layer = ad.layers(model)[0]
    assert not ad.is_moe and not ad.is_moe_layer(layer)
    assert set(ad.dense_mlp_projections(layer)) == {"gate_proj", "up_proj", "down_proj"}
    assert ad.num_experts(model.config) == 0


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as exc:
        get_adapter("gpt2")
    assert "gpt2" in str(exc.value) and "qwen3_moe" in str(exc.value) and "mixtral" in str(exc.value)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_glm_router_selects_with_the_correction_bias_and_gates_without_it(family):
    """GLM-4.5's and DeepSeek-V3's router: the bias changes which experts are chosen, not their
    gate values; the chosen experts lie in the best group; gates are normalized and scaled."""
    model = build_random_model(family)
    ad = get_adapter(model.config)
    layer = first_moe_layer(ad, model)
    x = torch.randn(256, model.config.hidden_size)
    routing = ad.route(layer, x, model.config)
    with torch.no_grad():
        _, ref_w, ref_i = ad.router(layer)(x)
    order, ref_order = routing.top_k_index.sort(-1), ref_i.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(routing.top_k_weights.gather(-1, order.indices),
                               ref_w.gather(-1, ref_order.indices))
    torch.testing.assert_close(routing.top_k_weights.sum(-1), torch.full((256,), 2.5))
    group = routing.top_k_index // 4  # two groups of four, topk_group = 1
    assert torch.equal(group[:, 0], group[:, 1])
    unbiased = torch.topk(routing.probs, 2, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, order.values)  # the bias (or the group) chose otherwise
    assert torch.equal(ad.saliency_gates(routing, model.config), routing.top_k_weights)


def test_ernie_router_selects_with_the_statics_bias_and_gates_with_the_softmax():
    """ERNIE-4.5's router: softmax scores; the [1, E] ``moe_statics`` bias changes which experts
    are chosen, and the gates are the chosen softmax values renormalized; REAP's gates are those
    the forward multiplies by."""
    model = build_random_model("ernie4_5_moe")
    ad = get_adapter(model.config)
    layer = first_moe_layer(ad, model)
    assert ad.leading_dense_layers(model.config) == 1 and not ad.is_moe_layer(ad.layers(model)[0])
    x = torch.randn(256, model.config.hidden_size)
    routing = ad.route(layer, x, model.config)
    with torch.no_grad():
        _, ref_w, ref_i = ad.router(layer)(x)
    assert torch.equal(routing.top_k_index, ref_i)
    torch.testing.assert_close(routing.top_k_weights, ref_w)
    torch.testing.assert_close(routing.top_k_weights.sum(-1), torch.ones(256))
    unbiased = torch.topk(routing.probs, 2, dim=-1).indices
    assert not torch.equal(unbiased, routing.top_k_index)  # the bias chose otherwise
    torch.testing.assert_close(ad.saliency_gates(routing, model.config), routing.top_k_weights)
    assert ad.disk_router_correction_key(1) == "model.layers.1.mlp.moe_statics.e_score_correction_bias"


def test_mla_sites_follow_the_attention_inputs():
    """Latent attention's projections grouped by the input they read: the layer input (q_a and
    kv_a), each low-rank norm's output (q_b, kv_b), the heads (o); without a query rank the
    query is one projection beside kv_a."""
    for q_rank, first in ((32, ("q_a_proj", "kv_a_proj_with_mqa")),
                          (None, ("q_proj", "kv_a_proj_with_mqa"))):
        model = build_random_model("deepseek_v3", q_lora_rank=q_rank)
        ad = get_adapter(model.config)
        layer = ad.layers(model)[0]
        sites = ad.attention_sites(layer)
        assert sites[0][0].projections == first and sites[-1][0].projections == ("o_proj",)
        attn = ad.attention(layer)
        for site in (s for stage in sites[1:-1] for s in stage):
            (name,) = site.projections
            norm = getattr(attn, site.norm)
            assert getattr(attn, name).in_features == norm.weight.numel()
        assert set(ad.attention_projections(layer)) == {
            p for stage in sites for s in stage for p in s.projections}
