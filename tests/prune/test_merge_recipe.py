"""The merge stage in recipes (validation naming the field, order, shared prefixes) and on the
command line (`thresher merge`)."""

import json

import pytest
from typer.testing import CliRunner

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.cli import app
from thresher.errors import RecipeError
from thresher.models import save_model
from thresher.recipe import MergeStage, parse_recipe

runner = CliRunner()


def recipe_with(*stages: dict) -> dict:
    return {"name": "t", "model": "demo:tiny", "variants": [{"name": "v", "stages": list(stages)}]}


@pytest.mark.parametrize("stage, field, message", [
    ({"merge": {"method": "zipit", "ratio": 0.5}}, "variants.0.stages.0.merge.method",
     "'m_smoe' or 'hc_smoe'"),
    ({"merge": {"method": "hc_smoe", "ratio": 1.5}}, "variants.0.stages.0.merge.ratio",
     "less than 1"),
    ({"merge": {"method": "hc_smoe", "ratio": 0.5, "keep": 4}}, "variants.0.stages.0.merge",
     "exactly one of 'ratio' and 'keep'"),
    ({"merge": {"method": "m_smoe", "ratio": 0.5, "linkage": "single"}},
     "variants.0.stages.0.merge", "linkage is hc_smoe's clustering"),
    ({"merge": {"method": "hc_smoe", "ratio": 0.5, "router": "first"}},
     "variants.0.stages.0.merge.router", "'leader' or 'average'"),
    ({"merge": {"ratio": 0.5, "heldout_fraction": 0.1}},
     "variants.0.stages.0.merge.heldout_fraction", "unknown key"),
    ({"merge": {"ratio": 0.5}, "prune": {"ratio": 0.5}}, "variants.0.stages.0",
     "exactly one of 'prune', 'merge' or 'quantize'"),
])
def test_recipe_errors_name_the_merge_field(stage, field, message):
    with pytest.raises(RecipeError) as exc:
        parse_recipe(recipe_with(stage))
    line = next(x for x in str(exc.value).splitlines() if x.strip().startswith(field + ":"))
    assert message in line, str(exc.value)


def test_merge_comes_before_quantize_and_shares_prefixes():
    with pytest.raises(RecipeError, match="prune and merge stages come before the quantize"):
        parse_recipe(recipe_with({"quantize": {"method": "rtn", "bits": 4}},
                                 {"merge": {"ratio": 0.5}}))
    data = recipe_with({"merge": {"method": "m_smoe", "ratio": 0.5}},
                       {"quantize": {"method": "rtn", "bits": 4}})
    data["variants"].append({"name": "m", "stages": [{"merge": {"method": "m_smoe", "ratio": 0.5}}]})
    recipe = parse_recipe(data)
    steps = recipe.plan()
    assert [s.stage.kind for s in steps] == ["merge", "quantize"]
    assert steps[0].variants == ["v", "m"] and steps[1].parent == 0
    assert steps[0].stage.describe() == "merge m_smoe ratio=0.5"
    assert MergeStage(method="m_smoe", keep=4).aligns and not MergeStage(keep=4).aligns


def test_merge_command_writes_checkpoint_and_report(tmp_path, tiny_tokenizer):
    save_model(build_random_model("olmoe", vocab_size=len(tiny_tokenizer)), tiny_tokenizer,
               tmp_path / "base")
    out = tmp_path / "merged"
    result = runner.invoke(app, ["merge", "--model", str(tmp_path / "base"), "--method", "m_smoe",
                                 "--keep", "6", "--router", "average", "--calibration",
                                 CALIBRATION_FILE, "--samples", "3", "--seq-len", "16",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "merge_report.json").read_text())
    assert report["method"] == "m_smoe" and report["router"] == "average" and report["permute"]
    assert report["experts_kept"] == 6 and len(report["layers"][0]["groups"]) == 6
    assert json.loads((out / "config.json").read_text())["num_experts"] == 6
    assert "merged groups" in result.output and "merged checkpoint" in result.output


def test_merge_command_reports_bad_options_without_traceback(tmp_path):
    save_model(build_random_model("llama", num_layers=1), None, tmp_path / "dense")
    for args, message in (
        (["--ratio", "1.5"], "--ratio"),
        (["--method", "zipit"], "--method"),
        (["--router", "first"], "--router"),
        (["--ratio", "0.5"], "dense model"),
    ):
        result = runner.invoke(app, ["merge", "--model", str(tmp_path / "dense"),
                                     "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()
