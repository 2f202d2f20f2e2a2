"""A user's own recipe end to end: a local model directory, calibration and evaluation from local
JSONL files, no base variant, GGUF q4_k_m asked for every variant. `thresher check` lists the
GGUF files, the run writes exactly those (each a requantization, measured), and the table takes
every variant's change from the base model with an interval."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from thresher.cli import app
from thresher.evaluate.report import VariantRecord, terminal_table
from thresher.export.llama_runtime import LLAMA_CPP_AVAILABLE
from thresher.formats.artifact import COMPARISON_MD, GGUF_SOURCE, MODEL_CARD
from thresher.recipe import load_recipe

pytestmark = pytest.mark.slow

VARIANTS = ["reap25-gptq4", "awq4", "gptq4-g64"]


def _jsonl(path: Path, source: str, lines_per_record: int = 30) -> str:
    """A standard-library file as JSONL records of a few lines each (a stand-in for a user's
    own data, unchanged when thresher's sources change)."""
    lines = Path(source).read_text().splitlines()
    with open(path, "w") as out:
        for i in range(0, len(lines), lines_per_record):
            out.write(json.dumps({"text": "\n".join(lines[i:i + lines_per_record])}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def user_recipe(tmp_path_factory, tiny_demo) -> Path:
    import argparse
    import json.decoder

    root = tmp_path_factory.mktemp("user")
    model = root / "my-model"
    shutil.copytree(tiny_demo, model)
    recipe = {
        "name": "mine",
        "model": str(model),
        "calibration": {"source": {"files": [_jsonl(root / "cal.jsonl", json.decoder.__file__)]},
                        "samples": 4, "seq_len": 64},
        "eval": {"perplexity": {"source": {"files": [_jsonl(root / "eval.jsonl",
                                                            argparse.__file__)]},
                                "seq_len": 64, "max_windows": 8}},
        "variants": [
            {"name": "reap25-gptq4", "stages": [
                {"prune": {"method": "reap", "ratio": 0.25}},
                {"quantize": {"method": "gptq", "bits": 4, "group_size": 32}}]},
            {"name": "awq4", "stages": [{"quantize": {"method": "awq", "bits": 4,
                                                      "group_size": 32}}]},
            {"name": "gptq4-g64", "stages": [{"quantize": {"method": "gptq", "bits": 4,
                                                           "group_size": 64}}]},
        ],
        "publish": {"formats": ["hf", "gguf"], "gguf_types": ["q4_k_m"],
                    "dir": str(root / "published")},
        "validate": {"enabled": False},
        "tracking": {"mlflow_uri": f"sqlite:///{root / 'mlflow.db'}"},
    }
    path = root / "mine.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def summary(user_recipe, prefect_server) -> dict:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from thresher.flows.compress import compress

    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        return compress(load_recipe(user_recipe),
                        store_dir=str(user_recipe.parent / "store"))


def test_check_lists_the_gguf_files_before_compute(user_recipe):
    result = CliRunner().invoke(app, ["check", str(user_recipe)])
    assert result.exit_code == 0, result.output
    rows = [" ".join(line.strip("│ ").split()) for line in result.output.splitlines()]
    gguf_rows = [r for r in rows if ".gguf" in r]
    assert gguf_rows == [f"{name} │ {name}-q4_k_m.gguf │ requantized: a second rounding; "
                         "perplexity measured" for name in VARIANTS]
    out = " ".join(result.output.split())
    assert "eval.jsonl, as you chose them" in out and "(held-out)" not in out


def test_run_writes_exactly_the_planned_files(summary, user_recipe):
    published = user_recipe.parent / "published" / "mine"
    dirs = sorted(p.name for p in published.iterdir() if p.name.endswith(".gguf"))
    assert dirs == sorted(f"{v}.gguf" for v in VARIANTS)
    for v in VARIANTS:
        files = sorted(p.name for p in (published / f"{v}.gguf").iterdir())
        assert files == sorted([MODEL_CARD, GGUF_SOURCE, f"{v}-q4_k_m.gguf"]), files
        assert "second rounding" in (published / f"{v}.gguf" / MODEL_CARD).read_text()
    if LLAMA_CPP_AVAILABLE:
        from thresher.export.llama_runtime import LlamaCppModel

        for v in VARIANTS:
            LlamaCppModel(published / f"{v}.gguf" / f"{v}-q4_k_m.gguf", n_ctx=64).close()


def test_the_base_is_the_reference_and_gguf_perplexity_is_in_the_table(summary):
    records = [VariantRecord.from_dict(v) for v in summary["variants"]]
    assert [r.name for r in records] == ["base", *VARIANTS]
    assert records[0].stages == "base" and records[0].perplexity > 1
    for r in records[1:]:
        (gguf,) = r.gguf_files()
        assert gguf.type == "q4_k_m" and gguf.requantized and gguf.perplexity > 1
    text = terminal_table(records)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120, text
    rows = {line.split()[0]: line for line in lines[2:] if line.strip()}
    assert "reference" in rows["base"]
    interval = re.compile(r"[+-]\d+\.\d\d% \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]")
    for name in VARIANTS:
        assert interval.search(rows[name]), text
    gguf_rows = [line for line in lines if "└ q4_k_m.gguf" in line]
    assert len(gguf_rows) == 3 and all(interval.search(line) for line in gguf_rows), text
    full = (Path(summary["report_dir"]) / COMPARISON_MD).read_text()
    assert "| reference |" in full and "awq4-q4_k_m.gguf" in full
