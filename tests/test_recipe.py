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
    assert len(prunes) == 1, "the 50% prune is computed once for all auto50 variants"
    assert set(prunes[0].variants) == {"auto50", "auto50-gptq4", "auto50-awq4", "auto50-nf4"}
    children = [s for s in plan if s.parent == prunes[0].index]
    assert {s.stage.quantize.method for s in children} == {"gptq", "awq", "nf4"}


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda r: r["variants"][1]["stages"][1]["quantize"].update(bits=5),
         "variants.1.stages.1.quantize.bits", "2, 3, 4, 8 or 'auto'"),
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
        (lambda r: r["variants"][1].update(validate={"draft": "r-q"}),
         "variants.1.validate.draft", "no variant named 'r-q' in this recipe (variants: base, "
         "r-g)"),
        (lambda r: r["variants"][1].update(validate={"draft": "r-g"}),
         "variants.1.validate.draft", "cannot be its own draft"),
        (lambda r: r["variants"][1].update(validate={"drafts": "base"}),
         "variants.1.validate.drafts", "unknown key"),
        (lambda r: (r["variants"][0].update(validate={"draft": "r-g"}),
                    r.update(validate={"enabled": False})),
         "variants.0.validate.draft", "validate.enabled is false"),
        (lambda r: r.update(validate={"enabled": False, "draft_of_base": True}),
         "validate.draft_of_base", "validate.enabled is false"),
        (lambda r: r.update(validate={"num_speculative_tokens": 17}),
         "validate.num_speculative_tokens", "less than or equal to 16"),
        (lambda r: r["variants"][1]["stages"].__setitem__(1, {"method": "gptq", "bits": 4}),
         "variants.1.stages.1", "under its kind (prune, merge or quantize): 'quantize: "
         "{method: gptq, bits: 4}'"),
        (lambda r: r["variants"][1]["stages"].__setitem__(0, {"method": "reap", "ratio": 0.5}),
         "variants.1.stages.0", "'prune: {method: reap, ratio: 0.5}'"),
        (lambda r: r["variants"][1]["stages"].__setitem__(0, {"method": "hc_smoe"}),
         "variants.1.stages.0", "'merge: {method: hc_smoe}'"),
        (lambda r: r["variants"][1]["stages"].__setitem__(0, {"method": "svd"}),
         "variants.1.stages.0.method", "unknown key"),
        # a source's errors name its own form's fields, not every form's
        (lambda r: r.update(calibration={"source": {"dataset": "wikitext"}}),
         "calibration.source", "a source is 'stdlib', {files: [paths or globs]} or {hf: "),
        (lambda r: r.update(calibration={"source": {"hf": "wikitext", "subset": "x"}}),
         "calibration.source.subset", "unknown key"),
        (lambda r: r.update(calibration={"source": {"files": []}}),
         "calibration.source.files", "at least 1 item"),
        (lambda r: r.update(calibration={"source": "stdlb"}), "calibration.source",
         "Input should be 'stdlib'"),
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
    assert len(text.splitlines()) == 2, text  # one problem, one line


def test_a_variant_names_another_as_its_draft():
    """The draft names another variant (a base may draft for a compressed variant too); a
    variant without its own validation settings dumps as it did, so its recipe hash holds."""
    data = base_recipe()
    data["variants"][0]["validate"] = {"draft": "r-g"}
    data["validate"] = {"draft_of_base": True}
    recipe = parse_recipe(data)
    assert recipe.variants[0].validate_.draft == "r-g" and recipe.variants[1].validate_ is None
    assert recipe.validate_.draft_of_base and recipe.validate_.num_speculative_tokens == 4
    dumped = recipe.model_dump(mode="json", by_alias=True)
    assert dumped["variants"][0]["validate"] == {"draft": "r-g"}
    assert set(dumped["variants"][1]) == {"name", "stages"}
    assert parse_recipe(dumped) == recipe


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
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(RecipeError, match="the recipe is empty; `thresher demo --print-recipe`"):
        load_recipe(empty)
    with pytest.raises(RecipeError, match=rf"^{tmp_path}: a directory, not a recipe file$"):
        load_recipe(tmp_path)
    binary = tmp_path / "model.safetensors"  # a wrong file named: no UnicodeDecodeError
    binary.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}\xff\xfe")
    with pytest.raises(RecipeError, match=r"model.safetensors: not a text file \(byte 10 is not"):
        load_recipe(binary)


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
    assert QuantizeStage(method="awq").select_on == "fit"
    assert QuantizeStage(method="awq", select_on="heldout").select_on == "heldout"
    with pytest.raises(ValidationError, match="'fit' or 'heldout'"):
        QuantizeStage(method="awq", select_on="train")
    with pytest.raises(ValidationError, match="select_on"):
        QuantizeStage(method="gptq", select_on="heldout")


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
    choices = schema["$defs"]["Stage"]["properties"]["quantize"]["anyOf"]
    methods = [schema["$defs"][c["$ref"].rsplit("/", 1)[-1]]["properties"]["method"]["const"]
               for c in choices if "$ref" in c]
    assert methods == ["rtn", "gptq", "awq", "nf4"] and {"type": "null"} in choices
    gptq = schema["$defs"]["GPTQStage"]["properties"]
    assert "act_order" in gptq and "clip" not in gptq
    assert "clip" in schema["$defs"]["AWQStage"]["properties"]


def test_check_prints_sweep_plan():
    result = CliRunner().invoke(app, ["check", str(ROOT / "configs" / "sweep-demo.yaml")])
    assert result.exit_code == 0, result.output
    for name in ("reap25-gptq3", "reap25-gptq4", "reap25-awq4", "reap50-awq4"):
        assert f"variant {name}:" in result.output
    # one REAP-25% step, used by its three quantized children
    assert "reap25-gptq3, reap25-gptq4, reap25-awq4" in result.output.replace("\n", " ")
    assert "7 variants; runs in this process" in result.output


def test_damage_budget_before_quantize_is_accepted_but_not_published_as_gguf():
    """A 'damage' prune leaves per-layer expert counts: thresher quantizes and serves them, but
    llama.cpp holds one expert count per model."""
    data = {"name": "r", "model": "demo:tiny", "variants": [{"name": "v", "stages": [
        {"prune": {"method": "auto", "ratio": 0.5, "budget": "damage"}},
        {"quantize": {"method": "gptq", "bits": 4}}]}]}
    variant = parse_recipe(data).variants[0]
    assert variant.per_layer_experts and [s.kind for s in variant.stages] == ["prune", "quantize"]
    data["variants"][0]["stages"][0]["prune"]["budget"] = "uniform"
    assert not parse_recipe(data).variants[0].per_layer_experts
    data["variants"][0]["stages"][0]["prune"]["budget"] = "damage"
    data["publish"] = {"formats": ["hf", "gguf"]}
    with pytest.raises(RecipeError, match="gguf holds one expert count per model, and v prune"):
        parse_recipe(data)


# --- calibration apart from evaluation -----------------------------------------------------------


def _with_sources(calibration, evaluation, **flags) -> dict:
    data = base_recipe()
    data["calibration"] = {"source": calibration, **flags}
    data["eval"] = {"perplexity": {"source": evaluation}}
    return data


def _refusal(data) -> str:
    with pytest.raises(RecipeError) as err:
        parse_recipe(data)
    message = str(err.value)
    assert "calibration.source and eval.perplexity.source" in message
    assert "calibration.allow_eval_overlap: true" in message  # says how to accept it
    return message


def test_calibrating_on_the_evaluation_files_is_refused_and_accepted_with_the_flag(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("def f():\n    return 1\n" * 50)
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    same = _with_sources({"files": [a]}, {"files": [str(tmp_path / "*.txt")]})  # a glob of it
    assert a in _refusal(same)
    same["calibration"]["allow_eval_overlap"] = True
    assert parse_recipe(same).calibration.allow_eval_overlap is True
    assert parse_recipe(_with_sources({"files": [a]}, {"files": [b]}))  # different files
    missing = str(tmp_path / "later" / "*.txt")  # a pattern naming nothing yet is itself
    _refusal(_with_sources({"files": [missing]}, {"files": [missing]}))


def test_the_same_dataset_split_is_refused_and_another_split_accepted():
    wiki = {"hf": "wikitext", "config": "wikitext-2-raw-v1", "split": "test"}
    assert "dataset 'wikitext' (config 'wikitext-2-raw-v1', split 'test')" in _refusal(
        _with_sources(wiki, dict(wiki)))
    assert parse_recipe(_with_sources({**wiki, "split": "train"}, wiki))
    assert parse_recipe(_with_sources(wiki, dict(wiki), allow_eval_overlap=True))


def test_stdlib_keeps_its_split_and_its_held_out_files_count_as_evaluation_text():
    """json/decoder.py is in the stdlib held-out split that evaluation scores; json/encoder.py
    is in the train split."""
    import json.decoder
    import json.encoder

    from thresher.recipe import stdlib_split_of

    assert (stdlib_split_of("json/decoder.py"), stdlib_split_of("json/encoder.py")) == (
        "heldout", "train")
    assert parse_recipe(_with_sources("stdlib", "stdlib"))
    message = _refusal(_with_sources({"files": [json.decoder.__file__]}, "stdlib"))
    assert "decoder.py (of the stdlib held-out split)" in message
    assert parse_recipe(_with_sources({"files": [json.encoder.__file__]}, "stdlib"))
    _refusal(_with_sources("stdlib", {"files": [json.encoder.__file__]}))


def test_check_refuses_the_overlap_on_the_command_line(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("x = 1\n" * 100)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_with_sources({"files": [str(text)]},
                                                   {"files": [str(text)]})))
    result = CliRunner().invoke(app, ["check", str(recipe)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "calibration.source and eval.perplexity.source" in result.output


def test_the_overlap_flag_is_not_part_of_the_store_key():
    from thresher.flows.store import stage_key
    from thresher.recipe import CalibrationConfig, Stage

    stage = Stage.model_validate({"quantize": {"method": "rtn", "bits": 4}})
    assert stage_key("h", stage, CalibrationConfig()) == stage_key(
        "h", stage, CalibrationConfig(allow_eval_overlap=True))
