"""Built-in tasks through lm-evaluation-harness on the tiny demo model, and a damaged control."""

from __future__ import annotations

import math

import pytest
import torch

from thresher.errors import DataError
from thresher.evaluate.builtin_tasks import NUM_CHOICES
from thresher.evaluate.report import VariantRecord, build_report
from thresher.evaluate.significance import paired_difference, paired_documents
from thresher.evaluate.tasks import TaskResults, run_tasks
from thresher.models import load_model

TASKS = ["stdlib_closing", "stdlib_identifier"]
DAMAGE_TASK = "stdlib_closing"  # the built-in task the tiny model's damage shows on most clearly
LIMIT = 120


def noise_damaged(path, relative_std: float = 2.0, seed: int = 0):
    """The tiny model with Gaussian noise of ``relative_std`` x each weight matrix's own std."""
    model = load_model(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * relative_std)
    return model


@pytest.fixture(scope="module")
def base_results(tiny_demo) -> TaskResults:
    return run_tasks(tiny_demo, tasks=TASKS, limit=LIMIT, batch_size=32, show_progress=False)


@pytest.fixture(scope="module")
def damaged_results(tiny_demo, tiny_tokenizer) -> TaskResults:
    return run_tasks(noise_damaged(tiny_demo), tiny_tokenizer, tasks=[DAMAGE_TASK], limit=LIMIT,
                     batch_size=32, backend="noise-damaged", show_progress=False)


@pytest.mark.slow
def test_base_model_scores_above_chance(base_results):
    for task in TASKS:
        acc = base_results.scores[task]["acc"]
        assert acc.value > 1 / NUM_CHOICES + 2 * acc.stderr, (task, acc)
        assert base_results.samples[task] == LIMIT
    assert base_results.batch_size == 32 and base_results.limit == LIMIT
    assert base_results.backend == "Qwen3MoeForCausalLM"
    assert base_results.lm_eval_version.startswith("0.4")
    assert all(len(h) == 64 for h in base_results.task_hashes.values())


@pytest.mark.slow
def test_damaged_model_scores_lower(base_results, damaged_results):
    base = base_results.scores[DAMAGE_TASK]["acc"]
    damaged = damaged_results.scores[DAMAGE_TASK]["acc"]
    assert damaged.value < base.value - 2 * base.stderr, (base, damaged)
    assert damaged_results.backend == "noise-damaged"
    # same task, same data
    assert damaged_results.task_hashes[DAMAGE_TASK] == base_results.task_hashes[DAMAGE_TASK]
    # same documents, compared one by one
    key = f"{DAMAGE_TASK}/acc"
    assert len(base_results.per_sample[key]) == len(damaged_results.per_sample[key]) == LIMIT
    assert sum(base_results.per_sample[key].values()) / LIMIT == pytest.approx(base.value)
    paired = paired_difference(*paired_documents(base_results.per_sample[key],
                                                 damaged_results.per_sample[key]))
    assert paired.beyond_noise and paired.delta < 0, paired


@pytest.mark.slow
def test_results_round_trip_into_the_report(tmp_path, base_results, damaged_results):
    metrics = base_results.metrics()
    assert set(metrics) == {f"task/{t}/{m}" for t in TASKS
                            for m in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}
    damaged = damaged_results.metrics()
    again = TaskResults.from_json(base_results.to_json())
    assert again == base_results
    assert again.params()["tasks/lm_eval_version"] == base_results.lm_eval_version

    records = [VariantRecord.from_metrics("base", {"size_bytes": 6e6, **metrics}),
               VariantRecord.from_metrics("noise", {"size_bytes": 6e6,
                                                    **damaged})]
    report = build_report(records, tmp_path)
    bars = report.task_bars
    assert bars["variants"] == ["base", "noise"]
    row = bars["tasks"].index(f"{DAMAGE_TASK}/acc")
    assert bars["values"][row] == [base_results.scores[DAMAGE_TASK]["acc"].value,
                                   damaged_results.scores[DAMAGE_TASK]["acc"].value]
    assert bars["stderr"][row][0] == base_results.scores[DAMAGE_TASK]["acc"].stderr
    assert math.isnan(bars["values"][bars["tasks"].index("stdlib_identifier/acc")][1])
    assert report.quality_vs_size[0]["metric"] == "mean task acc"
    points = {name: y for name, _, y in report.quality_vs_size[0]["points"]}
    assert points["noise"] == damaged[f"task/{DAMAGE_TASK}/acc"]


@pytest.mark.slow
def test_unknown_task_is_refused(tiny_demo):
    with pytest.raises(DataError, match="no_such_task"):
        run_tasks(tiny_demo, tasks=["stdlib_next_line", "no_such_task"], limit=2)
    with pytest.raises(DataError, match="no tasks"):
        run_tasks(tiny_demo, tasks=[])
