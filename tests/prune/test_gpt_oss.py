"""gpt-oss pruning: saliency from the gates its forward multiplies by (softmax over the selected
top-k logits), every criterion, ``auto``, damage budgets and the refit; router weight and bias and
expert biases sliced; a pruned checkpoint transformers loads and thresher evaluates alike, equal
to the unpruned model with the removed experts masked out of routing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model
from tests.models.test_gpt_oss import layerwise_logits
from tests.prune.test_api import experts_disabled
from thresher.models import get_adapter, load_model, save_model
from thresher.prune.api import prune_model
from thresher.prune.observer import ExpertObserver
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, tiny_tokenizer):
    model = build_random_model("gpt_oss", num_layers=2, vocab_size=len(tiny_tokenizer))
    path = tmp_path_factory.mktemp("gpt_oss") / "base"
    save_model(model, tiny_tokenizer, path)
    return model, path


@torch.no_grad()
def test_reap_gate_is_the_softmax_over_the_selected_logits(gpt_oss):
    model, _ = gpt_oss
    adapter = get_adapter(model.config)
    layer = adapter.layers(model)[0]
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
def test_pruned_gpt_oss_loads_in_transformers_and_matches_thresher_evaluation(gpt_oss, tmp_path,
                                                                             stage):
    model, base = gpt_oss
    out = tmp_path / "pruned"
    report = prune_model(base, stage, CAL, out, show_progress=False)
    adapter = get_adapter(model.config)
    assert [r.layer for r in report.layers] == [0, 1]
    pruned = load_model(out)
    for r in report.layers:
        layer, orig = adapter.layers(pruned)[r.layer], adapter.layers(model)[r.layer]
        router, experts = adapter.router(layer), adapter.experts(layer)
        torch.testing.assert_close(router.weight, adapter.router(orig).weight[r.kept])
        torch.testing.assert_close(router.bias, adapter.router(orig).bias[r.kept])
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj_bias"):
            torch.testing.assert_close(getattr(experts, name),
                                       getattr(adapter.experts(orig), name)[r.kept])
        if not stage.refit:
            torch.testing.assert_close(experts.down_proj, adapter.experts(orig).down_proj[r.kept])
    ids = torch.randint(0, model.config.vocab_size, (2, 24))  # longer than the sliding window
    with torch.no_grad():
        got = pruned(input_ids=ids).logits
    torch.testing.assert_close(layerwise_logits(out, ids), got, rtol=1e-4, atol=1e-4)
    if stage.budget == "uniform":  # plain transformers loads it too
        plain = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(input_ids=ids).logits, got, rtol=0, atol=0)
    if not stage.refit and stage.budget == "uniform":  # the masked unpruned model
        removed = {r.layer: r.removed for r in report.layers}
        with torch.no_grad(), experts_disabled(model, removed):
            torch.testing.assert_close(model(input_ids=ids).logits, got, rtol=1e-4, atol=1e-4)


def test_mxfp4_input_prunes_to_a_plain_checkpoint(gpt_oss, tmp_path, tiny_tokenizer):
    """A hub-layout MXFP4 checkpoint: pruned from its dequantized experts, written plain (no
    mxfp4 quantization_config), and plain transformers computes what thresher evaluates."""
    from tests.models.test_gpt_oss import _write_mxfp4

    _, base = gpt_oss
    _write_mxfp4(base, tmp_path / "mxfp4")
    tiny_tokenizer.save_pretrained(tmp_path / "mxfp4")
    out = tmp_path / "pruned"
    prune_model(tmp_path / "mxfp4", PruneStage(method="reap", ratio=0.5), CAL, out,
                show_progress=False)
    assert "quantization_config" not in AutoModelForCausalLM.from_pretrained(out).config.to_dict()
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits,
                                   layerwise_logits(out, ids), rtol=1e-4, atol=1e-4)
