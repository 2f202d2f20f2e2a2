"""ERNIE-4.5-MoE pruning (softmax router selecting with its [1, E] ``moe_statics`` bias): saliency
from the gates the forward multiplies by, every criterion, ``auto``, damage budgets and the refit,
and a pruned checkpoint transformers loads and thresher evaluates alike."""

import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import build_random_model, first_moe_layer
from tests.prune.test_glm4_moe import CAL, _layerwise_logits
from thresher.models import get_adapter, load_model, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.prune.api import prune_model
from thresher.prune.observer import ExpertObserver
from thresher.recipe import PruneStage


@pytest.fixture(scope="module")
def ernie(tmp_path_factory, tiny_tokenizer):
    model = build_random_model("ernie4_5_moe", num_layers=2, vocab_size=len(tiny_tokenizer))
    path = tmp_path_factory.mktemp("ernie") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


@torch.no_grad()
def test_reap_gate_is_the_renormalized_softmax_the_forward_multiplies_by(ernie):
    model, _ = ernie
    adapter = get_adapter(model.config)
    layer = first_moe_layer(adapter, model)
    x = torch.randn(128, model.config.hidden_size)
    observer = ExpertObserver(adapter, layer, model.config, layer_idx=1)
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
def test_pruned_ernie_loads_in_transformers_and_matches_thresher_evaluation(ernie, tmp_path,
                                                                            stage):
    model, base = ernie
    out = tmp_path / "pruned"
    report = prune_model(base, stage, CAL, out, show_progress=False)
    adapter = get_adapter(model.config)
    config = AutoConfig.from_pretrained(out)
    assert [r.layer for r in report.layers] == [1, 2]  # the dense first layer is not pruned
    assert config.moe_layer_start_index == 1 and config.moe_num_shared_experts == 2
    pruned = load_model(out)
    reader = CheckpointReader(out)
    for r in report.layers:
        router, orig = adapter.router(adapter.layers(pruned)[r.layer]), adapter.router(
            adapter.layers(model)[r.layer])
        assert router.weight.shape[0] == len(r.kept)
        torch.testing.assert_close(router.moe_statics.e_score_correction_bias,
                                   orig.moe_statics.e_score_correction_bias[:, r.kept])
        assert reader.shape(adapter.disk_router_correction_key(r.layer)) == (1, len(r.kept))
        shared = adapter.shared_expert(adapter.layers(pruned)[r.layer])
        torch.testing.assert_close(shared.down_proj.weight,
                                   adapter.shared_expert(adapter.layers(model)[r.layer])
                                   .down_proj.weight)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        got = pruned(input_ids=ids).logits
    torch.testing.assert_close(_layerwise_logits(out, ids), got, rtol=1e-4, atol=1e-4)
    if stage.budget == "uniform":  # plain transformers loads it too
        plain = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(input_ids=ids).logits, got, rtol=0, atol=0)


def test_the_multi_token_prediction_block_is_not_carried(ernie, tmp_path):
    """A hub checkpoint's ``model.mtp_*`` tensors (which transformers does not load) stay out of
    the pruned artifact, which then loads with no unexpected tensors."""
    from safetensors.torch import load_file, save_file

    _, base = ernie
    hub = tmp_path / "hub"
    shutil.copytree(base, hub)
    tensors = load_file(hub / "model.safetensors")
    tensors["model.mtp_linear_proj.0.weight"] = torch.zeros(64, 128)
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    (hub / "thresher.json").unlink(missing_ok=True)
    out = tmp_path / "pruned"
    prune_model(hub, PruneStage(method="frequency", ratio=0.5), CAL, out, show_progress=False)
    names = CheckpointReader(out).tensor_names()
    assert not any(n.startswith("model.mtp") for n in names)
    assert "model.embed_tokens.weight" in names
