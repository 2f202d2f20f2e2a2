"""A merge variant through the compress flow: merged, then quantized, evaluated, published and
validated in the serving engine, with the merged checkpoint shared with a merge-only variant."""

from __future__ import annotations

import json
import json.encoder
from pathlib import Path

import pytest

from thresher.formats.artifact import MERGE_REPORT
from thresher.models import get_adapter
from thresher.models.layerwise import load_config
from thresher.recipe import parse_recipe


def test_merge_then_quantize_variant_runs_publishes_and_validates(tmp_path, tiny_demo,
                                                                  prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from thresher.flows.compress import compress

    merge = {"merge": {"method": "hc_smoe", "ratio": 0.5}}
    data = {
        "name": "mrg", "model": str(tiny_demo),
        # a stdlib train-split file: the held-out perplexity does not score the calibration text
        "calibration": {"source": {"files": [json.encoder.__file__]}, "samples": 8, "seq_len": 64},
        "eval": {"perplexity": {"seq_len": 64, "max_windows": 4}},
        "variants": [{"name": "hc50", "stages": [merge]},
                     {"name": "hc50-rtn4", "stages": [merge, {"quantize": {
                         "method": "rtn", "bits": 4, "group_size": 64}}]}],
        "validate": {"concurrency": [1], "max_tokens": 8, "rounds": 1},
    }
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        summary = compress(parse_recipe(data), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                           store_dir=str(tmp_path / "store"), publish_dir=str(tmp_path / "pub"))
    rows = {row["variant"]: row for row in summary["variants"]}
    merged, quantized = rows["hc50"], rows["hc50-rtn4"]
    assert merged["experts_kept"] == quantized["experts_kept"] == 4
    assert merged["merge.experts_kept"] == 4 and merged["merge.merged_routed_share"] > 0
    assert quantized["merge.cache_hit"] == 1.0 or merged["merge.cache_hit"] == 1.0  # computed once
    merged_dir = Path(merged["artifact"])
    assert json.loads((merged_dir / MERGE_REPORT).read_text())["method"] == "hc_smoe"
    config = load_config(merged_dir)
    assert get_adapter(config).num_experts(config) == 4
    assert not (Path(quantized["artifact"]) / MERGE_REPORT).exists()  # a stage's own report only
    for row in (merged, quantized):
        assert row["validate/perplexity"] == pytest.approx(row["perplexity"], rel=0.02)
        assert 0 < row["validate/agreement"] <= 1
