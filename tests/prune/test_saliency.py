"""REAP, EAN and frequency against a direct computation on a hand-built MoE layer."""

import math

import pytest
import torch

from tests.conftest import build_random_model
from thresher.models import get_adapter
from thresher.prune.observer import ExpertObserver, ExpertStats
from thresher.prune.saliency import (
    ean,
    frequency,
    random_saliency,
    reap,
    saliency,
    super_experts,
    weighted_ean,
)

# 4 experts, top-2, hidden 4, expert width 2. Expert 2's router row is so negative that no token
# selects it: it must score 0 and be reported dead.
ROUTER = [[1.0, 0.5, -0.5, 0.0], [0.2, -1.0, 1.0, 0.5], [-9.0, -9.0, -9.0, -9.0],
          [0.5, 0.3, 0.8, -0.6]]
GATE = [[[0.5, -0.2, 0.1, 0.3], [0.0, 0.4, -0.3, 0.2]],
        [[-0.3, 0.2, 0.6, 0.0], [0.1, 0.1, 0.1, -0.4]],
        [[0.2, 0.2, 0.2, 0.2], [0.3, -0.3, 0.3, -0.3]],
        [[0.7, -0.1, 0.0, 0.4], [-0.2, 0.5, 0.1, 0.1]]]
UP = [[[0.1, 0.7, 0.0, -0.2], [0.4, -0.1, 0.2, 0.3]],
      [[0.6, 0.0, -0.5, 0.1], [-0.2, 0.3, 0.3, 0.3]],
      [[0.5, 0.5, 0.5, 0.5], [0.1, 0.2, 0.3, 0.4]],
      [[0.3, -0.4, 0.2, 0.6], [0.9, 0.1, -0.2, 0.0]]]
DOWN = [[[1.0, -0.5], [0.2, 0.3], [-0.4, 0.8], [0.6, 0.1]],
        [[0.3, 0.3], [-1.0, 0.2], [0.5, -0.5], [0.0, 0.9]],
        [[0.1, 0.1], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1]],
        [[-0.7, 0.4], [0.5, 0.5], [0.2, -0.9], [1.1, 0.0]]]
TOKENS = [[1.0, 0.0, 0.5, -1.0], [-0.5, 1.5, 0.2, 0.3], [0.3, -0.7, 2.0, 1.0],
          [1.2, 0.4, -0.3, 0.8], [0.0, 0.0, 1.0, 1.0]]


def matvec(m, v):
    return [sum(a * b for a, b in zip(row, v, strict=True)) for row in m]


def direct_statistics(renormalize: bool):
    """Counts, EAN sums and REAP means from the definitions, in plain Python."""
    count, norm_sum, gated_sum = [0] * 4, [0.0] * 4, [0.0] * 4
    for x in TOKENS:
        logits = matvec(ROUTER, x)
        z = sum(math.exp(v) for v in logits)
        probs = [math.exp(v) / z for v in logits]
        top = sorted(range(4), key=lambda e: -logits[e])[:2]
        denom = sum(probs[e] for e in top) if renormalize else 1.0
        for e in top:
            g = matvec(GATE[e], x)
            u = matvec(UP[e], x)
            h = [gi / (1 + math.exp(-gi)) * ui for gi, ui in zip(g, u, strict=True)]  # silu(g) * u
            norm = math.sqrt(sum(v * v for v in matvec(DOWN[e], h)))
            count[e] += 1
            norm_sum[e] += norm
            gated_sum[e] += probs[e] / denom * norm
    return count, norm_sum, [s / n if n else 0.0 for s, n in zip(gated_sum, count, strict=True)]


def hand_built_layer(norm_topk_prob: bool):
    model = build_random_model("qwen3_moe", hidden_size=4, num_layers=1, num_experts=4,
                               intermediate_size=2, vocab_size=16, norm_topk_prob=norm_topk_prob)
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.mlp.gate.weight.copy_(torch.tensor(ROUTER))
        layer.mlp.experts.gate_up_proj.copy_(torch.cat([torch.tensor(GATE), torch.tensor(UP)], 1))
        layer.mlp.experts.down_proj.copy_(torch.tensor(DOWN))
    return model.config, layer


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalized", "plain-softmax"])
def test_saliencies_match_direct_computation(norm_topk_prob):
    config, layer = hand_built_layer(norm_topk_prob)
    observer = ExpertObserver(get_adapter(config), layer, config, layer_idx=0)
    observer.add_batch(torch.tensor(TOKENS[:2]))  # two batches accumulate like one
    observer.add_batch(torch.tensor(TOKENS[2:]))
    stats = observer.stats
    count, norm_sum, reap_mean = direct_statistics(renormalize=norm_topk_prob)
    assert stats.tokens == len(TOKENS)
    assert frequency(stats).tolist() == count
    assert count[2] == 0 and len(set(count)) > 2  # uneven routing, one dead expert
    torch.testing.assert_close(ean(stats), torch.tensor(norm_sum, dtype=torch.float64), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(reap(stats), torch.tensor(reap_mean, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert stats.dead_experts() == [2]
    assert saliency("reap", stats)[2] == 0.0 and saliency("ean", stats)[2] == 0.0


def direct_weighted_ean_and_max(renormalize: bool):
    """The reference's weighted_ean_sum (sum of gate * ||f||) and max_activations, in Python."""
    weighted, largest = [0.0] * 4, [-math.inf] * 4
    for x in TOKENS:
        logits = matvec(ROUTER, x)
        z = sum(math.exp(v) for v in logits)
        probs = [math.exp(v) / z for v in logits]
        top = sorted(range(4), key=lambda e: -logits[e])[:2]
        denom = sum(probs[e] for e in top) if renormalize else 1.0
        for e in top:
            g, u = matvec(GATE[e], x), matvec(UP[e], x)
            out = matvec(DOWN[e], [gi / (1 + math.exp(-gi)) * ui
                                   for gi, ui in zip(g, u, strict=True)])
            weighted[e] += probs[e] / denom * math.sqrt(sum(v * v for v in out))
            largest[e] = max(largest[e], *out)
    return weighted, largest


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalized", "plain-softmax"])
def test_weighted_ean_and_max_activation_match_direct_computation(norm_topk_prob):
    config, layer = hand_built_layer(norm_topk_prob)
    observer = ExpertObserver(get_adapter(config), layer, config, layer_idx=0)
    observer.add_batch(torch.tensor(TOKENS[:3]))
    observer.add_batch(torch.tensor(TOKENS[3:]))
    weighted, largest = direct_weighted_ean_and_max(norm_topk_prob)
    torch.testing.assert_close(weighted_ean(observer.stats),
                               torch.tensor(weighted, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(saliency("weighted_ean", observer.stats),
                               reap(observer.stats) * frequency(observer.stats))
    torch.testing.assert_close(observer.stats.max_activation,
                               torch.tensor(largest, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert observer.stats.max_activation[2] == -math.inf  # dead: no maximum


def test_super_experts_are_the_outliers_of_the_first_three_quarters_of_the_layers():
    def stats(layer, maxima):
        s = ExpertStats.empty(layer, 4)
        s.max_activation = torch.tensor(maxima, dtype=torch.float64)
        return s

    layers = [stats(0, [1.0, 2.0, 1.5, 1.0]), stats(1, [1.2, 90.0, 0.8, -math.inf]),
              stats(2, [1.0, 1.1, 1.3, 0.9]), stats(3, [500.0, 1.0, 1.0, 1.0])]
    assert super_experts(layers, num_layers=4) == {0: [], 1: [], 2: []}  # the outlier is last
    layers[3].max_activation[0] = 2.0
    assert super_experts(layers, num_layers=4) == {0: [], 1: [1], 2: []}


def test_renormalized_gate_differs_from_plain_softmax():
    """The two gate rules give different REAP scores (the test above pins each one)."""
    scores = {}
    for flag in (True, False):
        config, layer = hand_built_layer(flag)
        observer = ExpertObserver(get_adapter(config), layer, config, layer_idx=0)
        observer.add_batch(torch.tensor(TOKENS))
        scores[flag] = reap(observer.stats)
    routed = scores[False] > 0
    assert torch.all(scores[True][routed] > scores[False][routed])


def test_mixtral_gate_is_the_plain_softmax_although_its_forward_renormalizes():
    model = build_random_model("mixtral", num_layers=1)
    adapter = get_adapter(model.config)
    assert adapter.forward_renormalizes(model.config)
    layer = model.model.layers[0]
    observer = ExpertObserver(adapter, layer, model.config, layer_idx=0)
    routing = adapter.route(layer, torch.randn(6, model.config.hidden_size), model.config)
    gates = observer.gates(routing)
    torch.testing.assert_close(gates, routing.probs.gather(-1, routing.top_k_index))
    assert not torch.allclose(gates, routing.top_k_weights)


def test_random_saliency_is_seeded():
    a = random_saliency(8, torch.Generator().manual_seed(3))
    b = random_saliency(8, torch.Generator().manual_seed(3))
    c = random_saliency(8, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
