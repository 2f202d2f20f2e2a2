"""`thresher check` of a committed real-model recipe against the model's own config.json, written
to a local directory that stands in for the hub download (`check` reads no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from thresher.cli import app


def check_against(recipe_file: Path, config: dict, model_dir: Path,
                  **quantize) -> tuple[int, str]:
    """Exit code and one-line output of `thresher check` on ``recipe_file`` with its model
    replaced by ``model_dir`` holding ``config``, and ``quantize`` set on every quantize stage."""
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    recipe = yaml.safe_load(recipe_file.read_text())
    recipe["model"] = str(model_dir)
    for variant in recipe["variants"]:
        for stage in variant["stages"]:
            stage.get("quantize", {}).update(quantize)
    path = model_dir.parent / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["check", str(path)])
    return result.exit_code, " ".join(result.output.split())
