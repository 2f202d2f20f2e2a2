"""Refitting the kept experts' down projections after pruning (``refit``)."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model, first_moe_layer
from tests.prune.test_api import CAL
from thresher.data.windows import calibration_windows, eval_windows
from thresher.evaluate.perplexity import perplexity
from thresher.formats.artifact import PRUNE_REPORT
from thresher.models import get_adapter, load_model, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.models.layerwise import LayerwiseModel
from thresher.models.random_init import MOE_FAMILIES
from thresher.prune.api import prune_model
from thresher.prune.observer import observe_experts
from thresher.prune.reconstruction import pruned_routing
from thresher.prune.refit import refit_down, routed_output_full
from thresher.recipe import CalibrationConfig, FilesSource, PerplexityConfig, PruneStage


def _layer(family: str, seed: int = 0):
    model = build_random_model(family, seed=seed, num_layers=1)
    adapter = get_adapter(model.config)
    return model, adapter, first_moe_layer(adapter, model)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@torch.no_grad()
def test_refit_reaches_the_joint_ridge_solution(family):
    """Block coordinate descent over the experts converges to the joint least-squares solution
    over all kept down projections at once (solved here directly)."""
    model, adapter, layer = _layer(family)
    config, hidden = model.config, model.config.hidden_size
    x = torch.randn(512, hidden, generator=torch.Generator().manual_seed(1))
    kept, damp = [0, 2, 5, 7], 0.05
    result = refit_down(adapter, layer, config, x, kept, damp, sweeps=200)

    y = routed_output_full(adapter, layer, config, x).double()
    logits = adapter.route(layer, x, config).logits.float()
    mask = torch.zeros(logits.shape[1], dtype=torch.bool)
    mask[kept] = True
    weights, index = pruned_routing(logits, mask, adapter.routing_rule(layer, config))
    blocks, lams, originals = [], [], []
    for j in kept:  # Z: every token's gated expert inputs, one column block per kept expert
        gate = (weights * (index == j)).sum(-1, keepdim=True)
        z = (gate * adapter.expert_hidden(layer, j, x)).double()
        blocks.append(z)
        bias = adapter.expert_down_bias(layer, j)
        if bias is not None:  # gpt-oss: the gated down bias is a fixed part, not fitted
            y -= gate.double() * bias.double()
        routed = (index == j).any(-1)
        lams.append(damp * float((z[routed].T @ z[routed]).diagonal().mean()) + 1e-12)
        originals.append(adapter.expert_view(layer, j).down.double().T)
    z_all = torch.cat(blocks, 1)
    inter = blocks[0].shape[1]
    lam = torch.cat([torch.full((inter,), lam) for lam in lams])
    solution = torch.linalg.solve(z_all.T @ z_all + torch.diag(lam),
                                  z_all.T @ y + lam[:, None] * torch.cat(originals))
    for n, j in enumerate(kept):
        torch.testing.assert_close(result.down[j].double(),
                                   solution[n * inter:(n + 1) * inter].T, rtol=1e-3, atol=1e-4)
    assert result.error_after < result.error_before


def test_refit_with_every_expert_kept_changes_nothing():
    model, adapter, layer = _layer("qwen3_moe")
    x = torch.randn(256, model.config.hidden_size)
    result = refit_down(adapter, layer, model.config, x, list(range(8)), damp=0.1)
    assert result.error_before < 1e-10
    for j in range(8):
        torch.testing.assert_close(result.down[j], adapter.expert_view(layer, j).down)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_refit_checkpoint_differs_from_the_plain_prune_only_in_kept_down_projections(
        family, tmp_path, tiny_tokenizer):
    model = build_random_model(family, num_layers=2, vocab_size=len(tiny_tokenizer))
    base = tmp_path / "base"
    save_model(model, tiny_tokenizer, base)
    plain, refit = tmp_path / "plain", tmp_path / "refit"
    prune_model(base, PruneStage(method="reap", ratio=0.5), CAL, plain, show_progress=False)
    report = prune_model(base, PruneStage(method="reap", ratio=0.5, refit=True), CAL, refit,
                         show_progress=False)

    assert (json.loads((refit / "config.json").read_text())
            == json.loads((plain / "config.json").read_text()))
    adapter = get_adapter(model.config)
    down_keys = {adapter.disk_expert_key(r.layer, e, "down") + ".weight" for r in report.layers
                 for e in range(4)}
    if adapter.fused_experts_on_disk:  # gpt-oss: one fused down projection a layer
        down_keys = {f"model.layers.{r.layer}.mlp.experts.down_proj" for r in report.layers}
    a, b = CheckpointReader(plain), CheckpointReader(refit)
    assert sorted(a.tensor_names()) == sorted(b.tensor_names())
    for name in a.tensor_names():
        if name in down_keys:
            assert b.get(name).dtype == a.get(name).dtype
            assert not torch.equal(a.get(name), b.get(name)), name
        else:
            assert torch.equal(a.get(name), b.get(name)), name
    data = json.loads((refit / PRUNE_REPORT).read_text())
    assert data["refit"] is True and 0 <= data["metrics"]["refit_error_left"] < 1
    for layer in data["layers"]:
        assert layer["refit_error_after"] < layer["refit_error_before"]
    assert report.metrics()["refit_error_left"] == data["metrics"]["refit_error_left"]
    AutoModelForCausalLM.from_pretrained(refit)  # plain transformers loads it


def test_refit_of_a_damage_budget_checkpoint_keeps_per_layer_counts(tiny_demo, tmp_path):
    cal = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=8, seq_len=64)
    out = tmp_path / "pruned"
    report = prune_model(tiny_demo, PruneStage(method="reap", ratio=0.5, budget="damage",
                                               refit=True), cal, out, show_progress=False)
    counts = [len(r.kept) for r in report.layers]
    assert AutoConfig.from_pretrained(out).layer_num_experts == counts
    adapter = get_adapter(AutoConfig.from_pretrained(out))
    for i, layer in enumerate(adapter.layers(load_model(out))):
        assert adapter.experts(layer).down_proj.shape[0] == counts[i]
    assert all(r.refit_error_after < r.refit_error_before for r in report.layers)


@pytest.fixture(scope="module")
def refit_ppl(tiny_demo, tiny_tokenizer, tmp_path_factory) -> dict[str, float]:
    """Held-out perplexity of the trained model pruned by half with and without the refit."""
    cal = CalibrationConfig(samples=32, seq_len=256)
    windows = eval_windows(tiny_tokenizer, PerplexityConfig(max_windows=32))
    cal_windows = calibration_windows(tiny_tokenizer, cal)
    observed = observe_experts(LayerwiseModel(tiny_demo), cal_windows, show_progress=False)
    ppl = {"base": perplexity(load_model(tiny_demo), windows, show_progress=False).perplexity}
    work = tmp_path_factory.mktemp("refit")
    runs = {"reap": PruneStage(method="reap", ratio=0.5),
            "reap refit": PruneStage(method="reap", ratio=0.5, refit=True),
            "auto damage refit": PruneStage(method="auto", ratio=0.5, budget="damage",
                                            refit=True)}
    for name, stage in runs.items():
        prune_model(tiny_demo, stage, cal, work / name,
                    observed=None if stage.method == "auto" else observed, show_progress=False)
        ppl[name] = perplexity(load_model(work / name), windows, show_progress=False).perplexity
    return ppl


@pytest.mark.slow
def test_refit_more_than_halves_the_perplexity_increase_of_reap_at_half(refit_ppl):
    """The refit recovers most of what pruning half the experts costs, on held-out text it never
    saw (on the demo models 5-16x less increase: docs/benchmarks.md)."""
    base = refit_ppl["base"]
    assert refit_ppl["reap refit"] - base < 0.5 * (refit_ppl["reap"] - base), refit_ppl


@pytest.mark.slow
def test_auto_damage_budget_with_refit_costs_less_than_half_of_uniform_reap(refit_ppl):
    base = refit_ppl["base"]
    assert refit_ppl["auto damage refit"] - base < 0.5 * (refit_ppl["reap"] - base), refit_ppl


def test_model_target_corrects_the_drift_of_earlier_pruned_layers(tmp_path, tiny_tokenizer):
    """``refit_target: model`` adds to the block's target what the layer must add for the pruned
    stream to rejoin the unpruned one: nothing at the first layer (no pruned layer before it, so
    the same fit as ``block``), something after it."""
    model = build_random_model("qwen3_moe", num_layers=2, vocab_size=len(tiny_tokenizer))
    base = tmp_path / "base"
    save_model(model, tiny_tokenizer, base)
    reports = {}
    for target in ("block", "model"):
        stage = PruneStage(method="reap", ratio=0.5, refit=True, refit_target=target)
        reports[target] = prune_model(base, stage, CAL, tmp_path / target, show_progress=False)
    a, b = CheckpointReader(tmp_path / "block"), CheckpointReader(tmp_path / "model")
    adapter = get_adapter(model.config)
    for e in range(4):
        key = adapter.disk_expert_key(0, e, "down") + ".weight"
        torch.testing.assert_close(a.get(key), b.get(key))
        key = adapter.disk_expert_key(1, e, "down") + ".weight"
        assert not torch.allclose(a.get(key), b.get(key)), key
    first, second = (r.refit_error_before for r in reports["model"].layers)
    assert first == pytest.approx(reports["block"].layers[0].refit_error_before)
    assert second > reports["block"].layers[1].refit_error_before  # the drift is added
    assert PruneStage(method="reap", ratio=0.5, refit=True, refit_target="block"
                      ).describe().endswith("refit(block)")
    assert PruneStage(method="reap", ratio=0.5, refit=True).refit_target == "model"


def test_refit_options_without_refit_are_refused():
    with pytest.raises(ValueError, match="refit_damp set without refit: true"):
        PruneStage(method="reap", ratio=0.5, refit_damp=0.1)
    PruneStage(method="reap", ratio=0.5, refit=True, refit_damp=0.1, refit_target="block")


def test_a_dumped_stage_validates_again():
    """Flows pass recipes as their JSON dump (every field set): defaults must validate."""
    for stage in (PruneStage(method="reap", ratio=0.5),
                  PruneStage(method="reap", ratio=0.5, refit=True, refit_target="block")):
        assert PruneStage.model_validate(stage.model_dump(mode="json")) == stage
