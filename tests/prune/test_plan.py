"""auto, damage budgets and super-expert protection on the trained `tiny` demo model.

What holds by construction is pinned: auto's chosen set has the least held-out local error of its
candidates, a damage budget removes the uniform total within its bounds with no more summed error
than the uniform split, protected experts stay. Perplexity orderings are in docs/benchmarks.md.
"""

import pytest
import torch

from tests.prune.test_api import experts_disabled
from thresher.data.windows import calibration_windows
from thresher.errors import CompressionError
from thresher.models import get_adapter, load_model
from thresher.models.adapters import RoutingRule
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.api import observe_for
from thresher.prune.mask import choose_experts
from thresher.prune.plan import AUTO_CANDIDATES, plan_layers
from thresher.prune.reconstruction import (
    LayerProbe,
    ProbeRecorder,
    greedy_removal_order,
    removal_error,
    routed_output,
)
from thresher.prune.saliency import reap, saliency
from thresher.recipe import CalibrationConfig, PruneStage

CAL = CalibrationConfig(samples=16, seq_len=128)
AUTO = PruneStage(method="auto", ratio=0.5, probe_tokens=1024)


@pytest.fixture(scope="module")
def observed(tiny_demo, tiny_tokenizer):
    lw = LayerwiseModel(tiny_demo)
    return observe_for(AUTO, lw, calibration_windows(tiny_tokenizer, CAL), show_progress=False)


def plan(observed, stage: PruneStage):
    return plan_layers(stage, observed, num_layers=4, num_experts=8, top_k=2,
                       n_keep=8 - int(8 * stage.ratio), model="demo:tiny")


def test_observation_holds_out_the_last_quarter_and_probes_every_moe_layer(observed):
    assert observed.heldout_windows == 4
    assert sorted(observed.heldout) == sorted(observed.search) == [s.layer for s in observed.stats]
    for probe in observed.heldout.values():
        assert probe.tokens == 4 * 128 and probe.outputs.shape[:2] == (8, 512)
        assert probe.residual_sq > 0
    assert all(s.tokens == 12 * 128 for s in observed.stats)  # saliency: the other windows


def test_auto_keeps_per_layer_the_candidate_with_least_heldout_error(observed):
    chosen = plan(observed, AUTO)
    for layer, choice in chosen.items():
        assert set(choice.errors) == set(AUTO_CANDIDATES) and len(choice.kept) == 4
        assert choice.local_error == min(choice.errors.values())
        probe = observed.heldout[layer]
        stats = next(s for s in observed.stats if s.layer == layer)
        for method in ("reap", "ean", "frequency", "weighted_ean"):
            single = removal_error(probe, choose_experts(saliency(method, stats), 4))
            assert choice.local_error <= single + 1e-12
            assert choice.errors[method] == pytest.approx(single)
    assert len({c.criterion for c in chosen.values()}) >= 1


def test_damage_budget_removes_the_uniform_total_within_bounds_and_least_error(observed):
    uniform = plan(observed, AUTO)
    damage = plan(observed, AUTO.model_copy(update={"budget": "damage"}))
    assert sum(8 - len(c.kept) for c in damage.values()) == 4 * 4
    assert all(len(c.kept) >= 2 for c in damage.values())  # 25% of 8, and top-k
    assert sum(c.local_error for c in damage.values()) <= sum(
        c.local_error for c in uniform.values()) + 1e-12
    half = plan(observed, AUTO.model_copy(update={"budget": "damage", "min_keep_fraction": 0.5}))
    assert all(len(c.kept) == 4 for c in half.values())  # the bound leaves no room to move


def test_super_experts_are_never_removed(observed):
    stats = observed.stats[0]
    weakest = int(torch.argmin(reap(stats)))
    saved = stats.max_activation.clone()
    stats.max_activation[weakest] = 1e6  # an extreme outlier in the first layer
    try:
        for stage in (PruneStage(method="reap", ratio=0.5, protect_super_experts=True),
                      AUTO.model_copy(update={"budget": "damage", "protect_super_experts": True})):
            chosen = plan(observed, stage)
            assert chosen[0].protected == [weakest] and weakest in chosen[0].kept
            assert all(c.protected == [] for layer, c in chosen.items() if layer != 0)
        assert weakest not in plan(observed, PruneStage(method="reap", ratio=0.5))[0].kept
    finally:
        stats.max_activation = saved


def test_auto_needs_the_heldout_probes(observed):
    with pytest.raises(CompressionError, match="held-out"):
        plan(observed.stats, AUTO)


def test_probe_recomputes_the_moe_block_of_the_full_and_the_pruned_layer(tiny_demo):
    model = load_model(tiny_demo)
    adapter = get_adapter(model.config)
    layer = adapter.layers(model)[1]
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    recorder = ProbeRecorder(adapter, layer, model.config, 1, max_tokens=48)
    assert recorder.add_batch(x) == 48 and recorder.add_batch(x) == 0
    probe = recorder.probe()
    with torch.no_grad():
        full = adapter.mlp(layer)(x[None, :48])[0]
        kept = [0, 2, 3, 6]
        with experts_disabled(model, {1: [1, 4, 5, 7]}):
            pruned = adapter.mlp(layer)(x[None, :48])[0]
    torch.testing.assert_close(routed_output(probe, torch.ones(8, dtype=torch.bool)), full,
                               rtol=1e-4, atol=1e-5)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[kept] = True
    torch.testing.assert_close(routed_output(probe, mask), pruned, rtol=1e-4, atol=1e-5)


def plain_greedy_order(probe, protected: list[int], max_remove: int) -> list[int]:
    """The greedy search as defined: every candidate's error recomputed on every token."""
    kept, order = list(range(probe.num_experts)), []
    for _ in range(max_remove):
        candidates = [e for e in kept if e not in protected]
        errors = [removal_error(probe, [k for k in kept if k != e]) for e in candidates]
        best = candidates[min(range(len(errors)), key=errors.__getitem__)]
        order.append(best)
        kept.remove(best)
    return order


def random_probe(rule: RoutingRule, experts: int = 16, tokens: int = 96, hidden: int = 8):
    gen = torch.Generator().manual_seed(experts + tokens)
    return LayerProbe(layer=0, logits=torch.randn(tokens, experts, generator=gen),
                      outputs=torch.randn(experts, tokens, hidden, generator=gen),
                      residual_sq=1.0, rule=rule)


@pytest.mark.parametrize("rule", [
    RoutingRule(top_k=4, renormalize=True),
    RoutingRule(top_k=4, renormalize=False),  # softmax over all experts: every token changes
    RoutingRule(top_k=4, renormalize=True, scoring="topk_softmax"),
    RoutingRule(top_k=4, renormalize=True, scoring="sigmoid", bias=torch.linspace(-0.2, 0.2, 16),
                n_group=4, topk_group=2, scaling=2.5),
    RoutingRule(top_k=4, renormalize=True, bias=torch.linspace(0.1, -0.1, 16)),
], ids=["softmax-renorm", "softmax", "topk-softmax", "sigmoid-groups", "softmax-bias"])
def test_greedy_order_equals_the_plain_search_for_every_rule(rule):
    probe = random_probe(rule)
    assert greedy_removal_order(probe, [3], 11) == plain_greedy_order(probe, [3], 11)


def test_greedy_order_equals_the_plain_search_on_the_trained_model(observed):
    for probe in observed.search.values():
        assert greedy_removal_order(probe, [], 6) == plain_greedy_order(probe, [], 6)
