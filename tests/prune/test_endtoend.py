"""``damage: loss`` on the trained `tiny` demo model: the end-to-end loss increase per layer.

Pinned: the measured loss of a pruning plan is the loss the written pruned checkpoint has on the
same held-out windows (so the measure is the model's, not a proxy), the report carries the
per-layer damage table the budget split and each candidate's loss increase, the split has no more
summed damage than the uniform one (by construction), and the recipe refuses a loss damage where
nothing reads it. Perplexity orderings are in docs/benchmarks.md.
"""

import json

import pytest
import torch
from pydantic import ValidationError

from thresher.data.windows import calibration_windows
from thresher.errors import CompressionError
from thresher.formats.artifact import PRUNE_REPORT
from thresher.models import load_model
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.api import observe_for, prune_model
from thresher.prune.endtoend import heldout_losses, loss_of, single_layer_damage
from thresher.prune.plan import AUTO_CANDIDATES, plan_layers
from thresher.recipe import CalibrationConfig, PruneStage

pytestmark = pytest.mark.slow  # one observation and one pruning of `tiny` (~30 s on 2 idle cores)

CAL = CalibrationConfig(samples=16, seq_len=128)
LOSS = PruneStage(method="auto", ratio=0.5, budget="damage", damage="loss", probe_tokens=1024)


@pytest.fixture(scope="module")
def observed(tiny_demo, tiny_tokenizer):
    lw = LayerwiseModel(tiny_demo)
    return observe_for(LOSS, lw, calibration_windows(tiny_tokenizer, CAL), show_progress=False)


@pytest.fixture(scope="module")
def pruned(tiny_demo, observed, tmp_path_factory):
    out = tmp_path_factory.mktemp("loss") / "tiny-auto-damage-loss"
    report = prune_model(tiny_demo, LOSS, CAL, out, observed=observed, show_progress=False)
    return report, out


def mean_nll(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]
    return float(torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)))


def test_measured_loss_is_the_written_checkpoints_loss(tiny_demo, observed, pruned):
    report, out = pruned
    windows = observed.heldout_ids
    plan = {r.layer: tuple(r.kept) for r in report.layers}
    full, joint = heldout_losses(LayerwiseModel(tiny_demo), windows, [{}, plan],
                                 show_progress=False)
    assert full == pytest.approx(mean_nll(load_model(tiny_demo), windows), abs=1e-4)
    assert joint == pytest.approx(mean_nll(load_model(out), windows), abs=1e-4)
    assert joint > full  # half the experts gone costs loss on a trained model


def test_report_carries_the_damage_table_and_each_candidates_loss_increase(observed, pruned):
    report, out = pruned
    assert report.damage == "loss" and report.loss_windows == observed.heldout_windows == 4
    assert sum(8 - len(r.kept) for r in report.layers) == 4 * 4
    for r in report.layers:
        assert set(r.errors) == set(AUTO_CANDIDATES)
        assert r.loss_increase == r.errors[r.criterion] == min(r.errors.values())
        assert len(r.damage) == 8 - 2 + 1 and r.damage[0] == 0.0  # keep >= 25% of 8 and top-k
        assert r.damage[8 - len(r.kept)] == r.loss_increase
        assert r.local_error is not None
    # the split: no more summed loss increase than removing 4 everywhere (which it considered)
    assert sum(r.loss_increase for r in report.layers) <= sum(
        r.damage[4] for r in report.layers) + 1e-12
    data = json.loads((out / PRUNE_REPORT).read_text())
    assert data["damage"] == "loss" and data["metrics"]["loss_increase_sum"] == pytest.approx(
        sum(r.loss_increase for r in report.layers))
    assert all(len(layer["damage"]) == 7 for layer in data["layers"])


def test_single_layer_damage_is_the_loss_of_pruning_that_layer_alone(tiny_demo, observed):
    lw = LayerwiseModel(tiny_demo)
    windows = observed.heldout_ids[:2]
    sets = {1: [(0, 1, 2, 3), (4, 5, 6, 7)], 3: [(0, 1, 2, 3)]}
    damage = single_layer_damage(loss_of(lw, windows, show_progress=False), sets)
    full, alone = heldout_losses(lw, windows, [{}, {1: (4, 5, 6, 7)}], show_progress=False)
    assert damage[1][(4, 5, 6, 7)] == pytest.approx(alone - full, abs=1e-6)
    assert set(damage) == {1, 3} and set(damage[1]) == set(sets[1])


def test_sequential_choice_adds_up_to_the_written_checkpoints_loss(tiny_demo, observed, tmp_path):
    stage = LOSS.model_copy(update={"sequential": True})
    out = tmp_path / "tiny-sequential"
    report = prune_model(tiny_demo, stage, CAL, out, observed=observed, show_progress=False)
    assert sum(8 - len(r.kept) for r in report.layers) == 4 * 4
    windows = observed.heldout_ids
    increase = mean_nll(load_model(out), windows) - mean_nll(load_model(tiny_demo), windows)
    # each layer's loss increase is over the earlier layers' choice: they add up to the model's
    assert sum(r.loss_increase for r in report.layers) == pytest.approx(increase, abs=1e-4)
    for r in report.layers:
        assert r.loss_increase == r.errors[r.criterion] == min(r.errors.values())


def test_loss_damage_needs_a_model_run_and_a_reader(observed):
    with pytest.raises(CompressionError, match="end_to_end"):
        plan_layers(LOSS, observed, num_layers=4, num_experts=8, top_k=2, n_keep=4,
                    model="demo:tiny")
    with pytest.raises(ValidationError, match="reads no damage"):
        PruneStage(method="reap", ratio=0.5, damage="loss")
    with pytest.raises(ValidationError, match="'local' or 'loss'"):
        PruneStage(method="auto", ratio=0.5, damage="kl")
    with pytest.raises(ValidationError, match="takes damage 'loss'"):
        PruneStage(method="auto", ratio=0.5, sequential=True)
    assert PruneStage(method="reap", ratio=0.5, budget="damage", damage="loss").damage == "loss"
