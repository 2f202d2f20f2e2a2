"""The comparison plots read at a glance: no label over another, one saliency panel per pruning."""

from __future__ import annotations

import itertools

import numpy as np
from matplotlib.text import Text

from thresher.evaluate.report import (
    LayerSaliency,
    VariantRecord,
    build_report,
    draw_quality_vs_size,
    quality_vs_size_data,
)


def _saliency(seed: int) -> list[LayerSaliency]:
    rng = np.random.default_rng(seed)
    return [LayerSaliency(i, rng.random(8).tolist(), sorted(rng.choice(8, 4, replace=False).tolist()))
            for i in range(4)]


def _demo_records() -> list[VariantRecord]:
    """The demo's eight variants as they measure: the quantized ones within 2% of each other in
    size and perplexity, where the labels used to print over each other."""
    base = 25.0e6
    records = [VariantRecord("base", size_bytes=base, perplexity=6.10, stages="base")]
    for name, size, ppl in (("gptq4", 0.155, 6.18), ("awq4", 0.152, 6.20), ("nf4", 0.150, 6.22)):
        records.append(VariantRecord(name, size_bytes=base * size, perplexity=ppl))
    pruned = _saliency(1)
    for name, size, ppl in (("reap50", 0.55, 7.90), ("reap50-gptq4", 0.090, 8.00),
                            ("reap50-awq4", 0.088, 8.01), ("reap50-nf4", 0.087, 8.03)):
        records.append(VariantRecord(name, size_bytes=base * size, perplexity=ppl,
                                     saliency=pruned))
    return records


def _sweep_records(n: int = 30) -> list[VariantRecord]:
    rng = np.random.default_rng(0)
    records = [VariantRecord("base", size_bytes=25e6, perplexity=6.1, stages="base")]
    for ratio, method in itertools.product((25, 50, 75), ("", "gptq4", "gptq3", "awq4", "nf4",
                                                          "rtn4", "gptq8", "rtn8", "gptq2", "awq3")):
        bits = {"": 32, "gptq8": 8.3, "rtn8": 8.3, "gptq3": 3.3, "gptq2": 2.3}.get(method, 4.2)
        records.append(VariantRecord(
            f"reap{ratio}" + (f"-{method}" if method else ""),
            size_bytes=25e6 * (1 - 0.009 * ratio) * bits / 32,
            perplexity=6.1 * (1 + ratio / 100) ** 2 * (1 + 0.05 * rng.random()),
            saliency=_saliency(ratio)))
    return records[:n]


def _labels(fig) -> list[tuple[object, list[str], list, np.ndarray]]:
    """Per data panel: the axes, its label texts, their pixel boxes, its points in pixels."""
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        points = np.concatenate([c.get_offsets() for c in ax.collections])
        out.append((ax, [t.get_text() for t in ax.texts],
                    [Text.get_window_extent(t, renderer) for t in ax.texts],  # no leader
                    ax.transData.transform(points)))
    return out


def _assert_readable(fig) -> None:
    for ax, _, boxes, points in _labels(fig):
        frame = ax.get_window_extent(fig.canvas.get_renderer())
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), (a, b)
        for box in boxes:
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0
            assert box.y1 <= frame.y1
            inside = [(x, y) for x, y in points
                      if box.x0 + 2 < x < box.x1 - 2 and box.y0 + 2 < y < box.y1 - 2]
            assert not inside, (box, inside)


def test_demo_scale_labels_by_name_without_overlap():
    records = _demo_records()
    fig = draw_quality_vs_size(quality_vs_size_data(records))
    fig.canvas.draw()
    (_, texts, _, _), = _labels(fig)
    assert sorted(texts) == sorted(r.name for r in records)
    _assert_readable(fig)


def test_sweep_scale_numbers_points_and_keys_them():
    records = _sweep_records()
    fig = draw_quality_vs_size(quality_vs_size_data(records))
    fig.canvas.draw()
    (_, texts, _, _), = _labels(fig)
    assert sorted(texts, key=int) == [str(i) for i in range(1, 31)]
    key = "\n".join(t.get_text() for t in fig.texts)  # beside the panels
    for i, r in enumerate(records, 1):
        assert f"{i:>3}  {r.name}\n" in key + "\n"
    _assert_readable(fig)


def test_one_saliency_panel_per_distinct_pruning(tmp_path):
    records = _demo_records() + [VariantRecord("reap25", size_bytes=20e6, perplexity=7.0,
                                               saliency=_saliency(2))]
    report = build_report(records, tmp_path)
    assert list(report.saliency) == ["reap50, reap50-gptq4, reap50-awq4, reap50-nf4", "reap25"]
    assert report.saliency["reap25"]["variants"] == ["reap25"]
    sweep = build_report(_sweep_records(), tmp_path / "sweep")
    assert [len(g["variants"]) for g in sweep.saliency.values()] == [10, 10, 9]
