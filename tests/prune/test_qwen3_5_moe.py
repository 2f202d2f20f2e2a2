"""Qwen3.5-MoE pruning: REAP's gate is the renormalized softmax the forward multiplies by; every
criterion, ``auto``, damage budgets and the refit give a checkpoint transformers loads and
thresher evaluates alike, with the shared expert and its gate untouched in every layer (linear-
and full-attention ones); a hub (multimodal) checkpoint prunes to the text model."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import build_random_model, first_moe_layer
from tests.models.test_qwen35 import write_hub_checkpoint
from tests.prune.test_glm4_moe import CAL, _layerwise_logits
from thresher.models import get_adapter, load_model, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.prune.api import prune_model
from thresher.prune.observer import ExpertObserver
from thresher.recipe import PruneStage


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, tiny_tokenizer):
    model = build_random_model("qwen3_5_moe", vocab_size=len(tiny_tokenizer))
    path = tmp_path_factory.mktemp("qwen35") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


@torch.no_grad()
def test_reap_gate_is_the_renormalized_softmax_the_forward_multiplies_by(qwen35):
    model, _ = qwen35
    adapter = get_adapter(model.config)
    layer = first_moe_layer(adapter, model)
    x = torch.randn(128, model.config.hidden_size)
    observer = ExpertObserver(adapter, layer, model.config, layer_idx=0)
    observer.add_batch(x)
    _, weights, index = adapter.router(layer)(x)  # transformers' own router
    want = torch.zeros(8, dtype=torch.float64)
    for e in range(8):
        token, slot = (index == e).nonzero(as_tuple=True)
        if token.numel():
            norm = adapter.expert_forward(layer, e, x[token]).double().norm(dim=-1)
            want[e] = (weights[token, slot].double() * norm).sum()
    torch.testing.assert_close(observer.stats.gated_norm_sum, want, rtol=1e-5, atol=1e-7)
    assert observer.stats.count.sum() == 128 * 2


@pytest.mark.parametrize("stage", [
    PruneStage(method="reap", ratio=0.5),
    PruneStage(method="frequency", ratio=0.5),
    PruneStage(method="ean", ratio=0.5),
    PruneStage(method="weighted_ean", ratio=0.5),
    PruneStage(method="auto", ratio=0.5),
    PruneStage(method="reap", ratio=0.5, refit=True),
    PruneStage(method="auto", ratio=0.5, budget="damage"),
], ids=["reap", "frequency", "ean", "weighted_ean", "auto", "reap-refit", "auto-damage"])
def test_pruned_qwen35_loads_in_transformers_and_matches_thresher_evaluation(qwen35, tmp_path,
                                                                             stage):
    model, base = qwen35
    out = tmp_path / "pruned"
    report = prune_model(base, stage, CAL, out, show_progress=False)
    adapter = get_adapter(model.config)
    config = AutoConfig.from_pretrained(out)
    assert [r.layer for r in report.layers] == [0, 1, 2, 3]  # both token mixers' layers
    assert config.layer_types == model.config.layer_types
    pruned = load_model(out)
    for r in report.layers:
        layer, orig = adapter.layers(pruned)[r.layer], adapter.layers(model)[r.layer]
        torch.testing.assert_close(adapter.router(layer).weight,
                                   adapter.router(orig).weight[r.kept])
        torch.testing.assert_close(adapter.shared_expert(layer).down_proj.weight,
                                   adapter.shared_expert(orig).down_proj.weight)
        torch.testing.assert_close(adapter.shared_expert_gate(layer).weight,
                                   adapter.shared_expert_gate(orig).weight)
        torch.testing.assert_close(adapter.attention(layer).state_dict(),
                                   adapter.attention(orig).state_dict())
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        got = pruned(input_ids=ids).logits
    torch.testing.assert_close(_layerwise_logits(out, ids), got, rtol=1e-4, atol=1e-4)
    if stage.budget == "uniform":  # plain transformers loads it too
        plain = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(input_ids=ids).logits, got, rtol=0, atol=0)


def test_a_hub_checkpoint_prunes_to_the_text_model(qwen35, tmp_path, tiny_tokenizer):
    """From the multimodal layout (fused experts under ``model.language_model.``, a vision tower
    and an MTP block), the pruned artifact is the text model: no vision or MTP tensors, config
    ``qwen3_5_moe_text``, and transformers loads it with thresher's logits."""
    model, _ = qwen35
    hub = write_hub_checkpoint(model, tmp_path / "hub")
    tiny_tokenizer.save_pretrained(hub)
    out = tmp_path / "pruned"
    prune_model(hub, PruneStage(method="reap", ratio=0.5), CAL, out, show_progress=False)
    names = CheckpointReader(out).tensor_names()
    assert not any(n.startswith(("model.visual.", "mtp.", "model.language_model.")) for n in names)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen3_5_moe_text" and config.num_experts == 4
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, _layerwise_logits(out, ids),
                                   rtol=1e-4, atol=1e-4)
