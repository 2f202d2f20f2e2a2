"""The Pareto front of a sweep in the model registry: ``best-under-<size>`` aliases.

The comparison report already draws the front of quality against size (``evaluate.report``).
Here the variants on the perplexity-vs-size front get a registry alias that says what they are
best at, so ``models:/NAME@best-under-13mb`` names a front variant without looking up versions.
"""

from __future__ import annotations

import math

from thresher.evaluate.report import VariantRecord, pareto_front
from thresher.tracking import Tracker

PARETO_TAG = "thresher.pareto_front"
_UNITS = ((1e9, "gb"), (1e6, "mb"), (1e3, "kb"), (1.0, "b"))


def size_label(size_bytes: float) -> str:
    """The size rounded up in the largest unit that keeps two digits: 12.3 MB -> ``13mb``,
    3.41 MB -> ``3410kb`` (at most 10 % above the size)."""
    for unit, name in _UNITS:
        if size_bytes / unit >= 10 or unit == 1.0:
            return f"{math.ceil(size_bytes / unit)}{name}"
    raise AssertionError("unreachable")


def pareto_aliases(records: list[VariantRecord]) -> dict[str, str]:
    """Variant name -> ``best-under-<size>`` for the variants on the perplexity-vs-size front."""
    points = [(r.name, float(r.size_bytes), float(r.perplexity)) for r in records
              if r.size_bytes is not None and r.perplexity is not None
              and math.isfinite(r.perplexity)]
    sizes = {name: size for name, size, _ in points}
    return {name: f"best-under-{size_label(sizes[name])}"
            for name in pareto_front(points, lower_is_better=True)}


def alias_pareto_front(tracker: Tracker, records: list[VariantRecord]) -> dict[str, str]:
    """Tag the front's MLflow runs and alias their registered versions; returns variant -> alias
    for the variants that have a registry entry."""
    aliased = {}
    front = pareto_aliases(records)
    for r in records:
        alias = front.get(r.name)
        if alias is None:
            continue
        if r.run_id:
            tracker.set_tags(r.run_id, {PARETO_TAG: "true"})
        if r.model_uri:
            name, version = r.model_uri.removeprefix("models:/").rsplit("/", 1)
            tracker.set_alias(name, alias, version)
            aliased[r.name] = alias
    return aliased
