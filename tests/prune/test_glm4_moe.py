"""GLM-4.5 and DeepSeek-V3 pruning (one router rule: sigmoid, score correction, groups): saliency
from the gates the forward multiplies by, every criterion, ``auto``, damage budgets and the refit,
and a pruned checkpoint transformers loads and thresher evaluates alike."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model, first_moe_layer
from thresher.models import get_adapter, load_model, save_model
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.api import prune_model
from thresher.prune.observer import ExpertObserver
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3"])
def glm(request, tmp_path_factory, tiny_tokenizer):
    model = build_random_model(request.param, num_layers=2, vocab_size=len(tiny_tokenizer))
    path = tmp_path_factory.mktemp(request.param) / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


def _layerwise_logits(path, ids):
    """thresher's own evaluation path: one decoder layer resident at a time."""
    lw = LayerwiseModel(path, torch.float32)
    lw.load_outer()
    hidden = lw.embed(ids)
    for i in range(lw.num_layers):
        lw.load_layer(i)
        hidden = lw.layer_forward(i, hidden)
        lw.release_layer(i)
    return lw.logits(hidden)


@torch.no_grad()
def test_reap_gate_is_the_scaled_unbiased_gate_of_the_forward(glm):
    model, _ = glm
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
def test_pruned_glm_loads_in_transformers_and_matches_thresher_evaluation(glm, tmp_path, stage):
    model, base = glm
    out = tmp_path / "pruned"
    report = prune_model(base, stage, CAL, out, show_progress=False)
    adapter = get_adapter(model.config)
    config = AutoConfig.from_pretrained(out)
    assert [r.layer for r in report.layers] == [1, 2]  # the dense first layer is not pruned
    assert config.n_group == config.topk_group == 1  # groups of unequal size: limit dropped
    assert config.num_nextn_predict_layers == 0 and config.first_k_dense_replace == 1
    pruned = load_model(out)
    for r in report.layers:
        router, orig = adapter.router(adapter.layers(pruned)[r.layer]), adapter.router(
            adapter.layers(model)[r.layer])
        assert router.weight.shape[0] == len(r.kept)
        torch.testing.assert_close(router.e_score_correction_bias,
                                   orig.e_score_correction_bias[r.kept])
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
