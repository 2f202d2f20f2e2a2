import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from thresher.cli import app
from thresher.errors import RecipeError
from thresher.recipe import (
    QUANTIZE_STAGE,
    AWQStage,
    GPTQStage,
    NF4Stage,
    QuantizeStage,
    load_recipe,
    parse_recipe,
)

ROOT = Path(__file__).resolve().parents[1]


def base_recipe() -> dict:
    return {
        "name": "t",
        "model": "demo:tiny",
        "variants": [
            {"name": "base", "stages": []},
            {"name": "r-g", "stages": [{"prune": {"method": "reap", "ratio": 0.5}},
                                       {"quantize": {"method": "gptq", "bits": 4}}]},
        ],
    }


@pytest.mark.parametrize(
    "path", sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "schedules.yaml")
)
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.variants


def test_demo_recipe_shares_prefixes():
    recipe = load_recipe(ROOT / "configs" / "demo.yaml")
    plan = recipe.plan()
    prunes = [s for s in plan if s.stage.kind == "prune"]
    assert len(prunes) == 1, "REAP-50% is computed once for all reap50 variants"
    assert set(prunes[0].variants) == {"reap50", "reap50-gptq4", "reap50-awq4", "reap50-nf4"}
    children = [s for s in plan if s.parent == prunes[0].index]
    assert {s.stage.quantize.method for s in children} == {"gptq", "awq", "nf4"}


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda r: r["variants"][1]["stages"][1]["quantize"].update(bits=5),
         "variants.1.stages.1.quantize.bits", "2, 3, 4 or 8"),
        (lambda r: r.update(calibration={"sampels": 3}), "calibration.sampels", "unknown key"),
        (lambda r: r["variants"][1]["stages"][0]["prune"].update(ratio=1.5),
         "variants.1.stages.0.prune.ratio", "(0, 1)"),
        (lambda r: r["variants"][1]["stages"][1].update(quantize={"method": "nf4", "bits": 3}),
         "variants.1.stages.1.quantize", "4-bit"),
        (lambda r: r["variants"].append({"name": "base"}), "variants", "used twice"),
        (lambda r: r["variants"][1]["stages"].reverse(), "variants.1.stages", "before the quantize"),
        (lambda r: r["variants"][1]["stages"][0].update(quantize={"method": "rtn"}),
         "variants.1.stages.0", "exactly one"),
        (lambda r: r.pop("model"), "model", "Field required"),
        (lambda r: r["variants"][1]["stages"][1]["quantize"].update(group_size=100),
         "variants.1.stages.1.quantize.group_size", "multiple of 8"),
        (lambda r: r.update(validate={"rounds": 0}), "validate.rounds", "greater than 0"),
        (lambda r: r.update(validate={"concurrency": [4, 0]}), "validate.concurrency.1",
         "greater than 0"),
    ],
)
def test_errors_name_the_field(mutate, field, words):
    data = base_recipe()
    mutate(data)
    with pytest.raises(RecipeError) as exc:
        parse_recipe(data)
    text = str(exc.value)
    assert f"  {field}:" in text, text
    assert words in text, text


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="no such recipe"):
        load_recipe(tmp_path / "missing.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(listy)


def test_defaults_fill_in():
    r = parse_recipe(base_recipe())
    assert r.calibration.source == "stdlib" and r.calibration.samples == 128
    assert r.validate_.concurrency == [1, 4, 16] and r.validate_.rounds == 2
    q = r.variants[1].stages[1].quantize
    assert q.group_size == 128 and q.keep_16bit == ["router", "embeddings", "lm_head"]


@pytest.mark.parametrize(
    "quantize, field, words",
    [
        ({"method": "gptq", "clip": True}, "quantize.clip", "unknown key for method gptq"),
        ({"method": "rtn", "act_order": True}, "quantize.act_order", "belongs to method gptq"),
        ({"method": "nf4", "sym": True}, "quantize.sym", "methods rtn and gptq and awq"),
        ({"method": "awq", "damp_percent": 0.1}, "quantize.damp_percent", "method awq"),
        ({"method": "gpt"}, "quantize", "'method' must be one of rtn, gptq, awq, nf4"),
    ],
)
def test_a_knob_of_another_method_is_refused(quantize, field, words):
    data = base_recipe()
    data["variants"][1]["stages"][1]["quantize"] = quantize
    with pytest.raises(RecipeError) as exc:
        parse_recipe(data)
    text = str(exc.value)
    assert f"  variants.1.stages.1.{field}:" in text, text
    assert words in text, text


def test_each_method_holds_only_its_own_knobs():
    gptq = QuantizeStage(method="gptq", act_order=True)
    assert isinstance(gptq, GPTQStage)
    dumped = set(gptq.model_dump())
    assert {"act_order", "damp_percent", "min_expert_tokens"} <= dumped
    assert not dumped & {"clip", "duo_scaling", "double_quant", "compute_dtype"}
    with pytest.raises(ValidationError, match="double_quant"):
        QuantizeStage(method="gptq", double_quant=True)
    # defaults are the method's own: GPTQ symmetric, RTN and AWQ asymmetric
    assert gptq.sym and not QuantizeStage(method="rtn").sym and not QuantizeStage(method="awq").sym
    assert isinstance(QUANTIZE_STAGE.validate_python({"method": "nf4"}), NF4Stage)


def test_model_copy_to_another_method_takes_that_methods_defaults():
    stage = QuantizeStage(method="rtn", group_size=32).model_copy(
        update={"method": "awq", "clip": True})
    assert isinstance(stage, AWQStage)
    assert (stage.group_size, stage.clip, stage.duo_scaling, stage.sym) == (32, True, True, False)
    gptq = QuantizeStage(method="rtn").model_copy(update={"method": "gptq", "bits": 3})
    assert isinstance(gptq, GPTQStage) and gptq.sym and gptq.bits == 3


def test_schema_holds_the_method_union():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.output)
    stage = schema["$defs"]["Stage"]["properties"]["quantize"]["anyOf"][0]
    assert set(stage["discriminator"]["mapping"]) == {"rtn", "gptq", "awq", "nf4"}
    gptq = schema["$defs"]["GPTQStage"]["properties"]
    assert "act_order" in gptq and "clip" not in gptq
    assert "clip" in schema["$defs"]["AWQStage"]["properties"]
