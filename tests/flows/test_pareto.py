"""The Pareto front of a sweep becomes ``best-under-<size>`` aliases in a real MLflow registry."""

from __future__ import annotations

from thresher.evaluate.report import VariantRecord
from thresher.flows.pareto import PARETO_TAG, alias_pareto_front, pareto_aliases, size_label
from thresher.tracking import Tracker


def test_size_label_rounds_up_within_ten_percent():
    assert size_label(12.3e6) == "13mb"
    assert size_label(3.41e6) == "3410kb"
    assert size_label(8.5e9) == "8500mb"
    assert size_label(950.0) == "950b"


def records() -> list[VariantRecord]:
    # (size MB, perplexity): base is big and best; a is small and good; b is dominated by a;
    # c is smallest and worst; d has no perplexity
    data = {"base": (40e6, 5.0), "a": (12.3e6, 5.5), "b": (14e6, 6.0), "c": (6e6, 9.0),
            "d": (5e6, None)}
    return [VariantRecord(name=n, size_bytes=s, perplexity=p) for n, (s, p) in data.items()]


def test_front_is_the_undominated_variants():
    assert pareto_aliases(records()) == {"c": "best-under-6000kb", "a": "best-under-13mb",
                                         "base": "best-under-40mb"}


def test_aliases_land_in_the_registry(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="pareto")
    recs = records()
    for r in recs:
        r.run_id = tracker.start_run(r.name)
        artifact = tmp_path / r.name
        artifact.mkdir()
        (artifact / "w.bin").write_bytes(r.name.encode())
        version = tracker.register(f"sw-{r.name}", artifact, r.name, r.run_id, tags={})
        r.model_uri = f"models:/sw-{r.name}/{version}"
        tracker.end_run(r.run_id)
    assert alias_pareto_front(tracker, recs) == {"c": "best-under-6000kb", "a": "best-under-13mb",
                                                 "base": "best-under-40mb"}
    assert str(tracker.model_version("sw-a@best-under-13mb").version) == "1"
    assert tracker.get_run(recs[1].run_id).data.tags[PARETO_TAG] == "true"
    assert PARETO_TAG not in tracker.get_run(recs[2].run_id).data.tags  # b: dominated
