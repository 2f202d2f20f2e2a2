"""`thresher check` against the model's shapes: refusals name the field and the model's numbers,
and the plan says which GGUF files each variant gets and where the evaluation text comes from.
Nothing here trains or computes: the demo configs come from their specs, local models are a
config.json in a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from thresher.cli import app
from thresher.errors import RecipeError
from thresher.flows.preflight import describe_source, preflight, read_model_config
from thresher.models.random_init import random_config
from thresher.recipe import FilesSource, parse_recipe

runner = CliRunner()

GPTQ4_G32 = {"quantize": {"method": "gptq", "bits": 4, "group_size": 32}}
REAP25 = {"prune": {"method": "reap", "ratio": 0.25}}


def recipe(model: str, variants: list[dict], gguf_types: list[str] | None = None,
           **extra) -> dict:
    publish = {"formats": ["hf", "gguf"], "gguf_types": gguf_types} if gguf_types else {}
    return {"name": "mine", "model": model, "variants": variants, "publish": publish, **extra}


def local_model(tmp_path, **kw) -> str:
    """A model directory holding only its config (the shapes are all `check` reads)."""
    path = tmp_path / "model"
    path.mkdir()
    random_config("qwen3_moe", **kw).save_pretrained(path)
    return str(path)


def test_demo_group_size_that_does_not_divide_is_refused_with_the_width():
    """demo:tiny's experts read 64 inputs in their down projection: group size 128 cannot fit."""
    bad = recipe("demo:tiny", [{"name": "ok", "stages": [GPTQ4_G32]},
                               {"name": "g128", "stages": [
                                   {"quantize": {"method": "gptq", "bits": 4,
                                                 "group_size": 128}}]}])
    with pytest.raises(RecipeError) as err:
        preflight(parse_recipe(bad))
    text = str(err.value)
    assert text.startswith("variants.1.stages.0.quantize.group_size: group_size=128")
    assert "the 64 inputs of model.layers.0.mlp.experts.0.down_proj" in text


@pytest.mark.parametrize("section, field", [("calibration", "calibration.seq_len"),
                                              ("eval", "eval.perplexity.seq_len")])
def test_windows_longer_than_the_models_context_are_refused(section, field):
    """demo:tiny is trained on 1,024 positions: a 2,048-token window names its field."""
    data = {"calibration": {"seq_len": 2048}} if section == "calibration" else {
        "eval": {"perplexity": {"seq_len": 2048}}}
    with pytest.raises(RecipeError) as err:
        preflight(parse_recipe(recipe("demo:tiny", [{"name": "base"}], **data)))
    assert str(err.value).startswith(f"{field}: 2048 is longer than the model's context (1024")
    preflight(parse_recipe(recipe("demo:tiny", [{"name": "base"}],
                                  calibration={"seq_len": 1024})))  # the edge is valid


@pytest.mark.parametrize("section, field", [("calibration", "calibration.source.files"),
                                              ("eval", "eval.perplexity.source.files")])
def test_local_text_files_that_match_nothing_are_refused_before_the_run(section, field,
                                                                        tmp_path):
    """A glob that matches no file fails `check` and the flow's first step, not the first stage
    after the base model's evaluation; an unknown hub model is no excuse to skip it."""
    (tmp_path / "a.txt").write_text("def f():\n    return 1\n")
    source = {"files": [str(tmp_path / "*.txt"), str(tmp_path / "gone" / "*.txt")]}
    data = ({"calibration": {"source": source, "allow_eval_overlap": True}}
            if section == "calibration" else {"eval": {"perplexity": {"source": source}}})
    for model in ("demo:tiny", "nobody/not-cached-here"):
        with pytest.raises(RecipeError, match=rf"^{field}: '{tmp_path}/gone/\*.txt' matches "
                                              "no file"):
            preflight(parse_recipe(recipe(model, [{"name": "base"}], **data)))
    source["files"].pop()
    preflight(parse_recipe(recipe("demo:tiny", [{"name": "base"}], **data)))


def test_demo_config_is_known_without_training():
    config, where = read_model_config("demo:small")
    assert (config.hidden_size, config.moe_intermediate_size, config.num_experts) == (256, 128, 8)
    assert "small" in where


def test_a_quantized_base_is_refused_for_stages_and_accepted_for_evaluation(tmp_path):
    """A GPTQ checkpoint as the recipe's model: no stage can read its packed weights, so a
    variant with stages is refused before the run (it failed at the first stage, after the base
    had been evaluated); a recipe that only evaluates it passes."""
    from thresher.formats.gptq import quantization_config

    model = local_model(tmp_path)
    config = json.loads((Path(model) / "config.json").read_text())
    config["quantization_config"] = quantization_config(
        bits=4, group_size=32, sym=True, desc_act=False, static_groups=False, damp_percent=0.01,
        true_sequential=True, modules_to_not_convert=[])
    (Path(model) / "config.json").write_text(json.dumps(config))
    refused = rf"^model: {model}/config.json: holds GPTQ 4-bit weights; .* give the model it was"
    with pytest.raises(RecipeError, match=refused + " quantized from$"):
        preflight(parse_recipe(recipe(model, [{"name": "base"}, {"name": "g",
                                                                 "stages": [GPTQ4_G32]}])))
    assert preflight(parse_recipe(recipe(model, [{"name": "base"}]))).checked


def test_prune_leaving_fewer_experts_than_top_k_is_refused(tmp_path):
    """Two prunes in a row: the second one counts the experts the first left (8 -> 4 -> 1)."""
    model = local_model(tmp_path, num_experts=8, top_k=2)
    bad = recipe(model, [{"name": "p", "stages": [
        {"prune": {"method": "reap", "ratio": 0.5}},
        {"prune": {"method": "frequency", "ratio": 0.75}}]}])
    with pytest.raises(RecipeError, match=r"^variants\.0\.stages\.1\.prune\.ratio: the model "
                                          r"\(4 experts per layer, top-2\): pruning would leave 1"):
        preflight(parse_recipe(bad))


def test_merge_counts_like_a_prune_and_is_checked_too(tmp_path):
    """A merge stage leaves its groups as the expert count later stages see (8 -> 4 -> 1), and a
    merge then quantize variant passes."""
    model = local_model(tmp_path, num_experts=8, top_k=2)
    merge = {"merge": {"method": "hc_smoe", "ratio": 0.5}}
    assert preflight(parse_recipe(recipe(model, [{"name": "m", "stages": [merge, GPTQ4_G32]}])))
    bad = recipe(model, [{"name": "m", "stages": [
        merge, {"prune": {"method": "frequency", "ratio": 0.75}}]}])
    with pytest.raises(RecipeError, match=r"^variants\.0\.stages\.1\.prune\.ratio: the model "
                                          r"\(4 experts per layer, top-2\)"):
        preflight(parse_recipe(bad))
    bad = recipe(model, [{"name": "m", "stages": [{"merge": {"method": "m_smoe", "keep": 1}}]}])
    with pytest.raises(RecipeError, match=r"^variants\.0\.stages\.0\.merge\.keep: "):
        preflight(parse_recipe(bad))


def test_gguf_type_the_rows_cannot_hold_is_refused(tmp_path):
    """Rows of 48 values fit no block of 32: no quantized GGUF type can hold them."""
    model = local_model(tmp_path, hidden_size=64, intermediate_size=48)
    with pytest.raises(RecipeError, match=r"^publish\.gguf_types: GGUF q8_0: .* rows of 48 "
                                          r"values, not a multiple of the Q8_0 block of 32"):
        preflight(parse_recipe(recipe(model, [{"name": "p", "stages": [REAP25]}], ["q8_0"])))
    preflight(parse_recipe(recipe(model, [{"name": "p", "stages": [REAP25]}], ["f16"])))


def test_gguf_plan_per_variant_hand_off_or_requantized():
    found = preflight(parse_recipe(recipe("demo:tiny", [
        {"name": "base", "stages": []},
        {"name": "reap25-gptq4", "stages": [REAP25, GPTQ4_G32]},
        {"name": "awq4", "stages": [{"quantize": {"method": "awq", "bits": 4,
                                                  "group_size": 64}}]},
        {"name": "actorder", "stages": [{"quantize": {"method": "gptq", "bits": 4,
                                                      "group_size": 32, "act_order": True,
                                                      "static_groups": False}}]},
        {"name": "reap25", "stages": [REAP25]}], ["q4_k_m", "q4_1"])))
    how = {v: {f.file: f.how for f in files} for v, files in found.gguf.items()}
    assert how == {
        "reap25-gptq4": {"reap25-gptq4-q4_k_m.gguf": "requantized",
                         "reap25-gptq4-q4_1.gguf": "hand-off"},
        "awq4": {"awq4-q4_k_m.gguf": "requantized", "awq4-q4_1.gguf": "requantized"},
        "actorder": {"actorder-q4_k_m.gguf": "requantized", "actorder-q4_1.gguf": "requantized"},
        "reap25": {"reap25-q4_k_m.gguf": "quantized", "reap25-q4_1.gguf": "quantized"},
    }  # the base variant is not published


def test_sources_say_what_is_true():
    assert "held-out split" in describe_source("stdlib", "evaluation")
    text = describe_source(FilesSource(files=["eval.jsonl"]), "evaluation")
    assert "eval.jsonl" in text and "you chose" in text and "held-out" in text
    assert "(held-out)" not in text and "has no held-out split" in text


def test_check_prints_files_reference_and_sources(tmp_path):
    model = local_model(tmp_path, hidden_size=64, intermediate_size=64)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": "x = 1\n"}) + "\n")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(
        model, [{"name": "reap25-gptq4", "stages": [REAP25, GPTQ4_G32]},
                {"name": "awq4", "stages": [{"quantize": {"method": "awq", "bits": 4,
                                                          "group_size": 32}}]}],
        ["q4_k_m"], eval={"perplexity": {"source": {"files": [str(tmp_path / "eval.jsonl")]}}})))
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 0, result.output
    rows = [" ".join(line.strip("│ ").split()) for line in result.output.splitlines()]
    assert "reap25-gptq4 │ reap25-gptq4-q4_k_m.gguf │ requantized: a second rounding; " \
           "perplexity measured" in rows
    assert "awq4 │ awq4-q4_k_m.gguf │ requantized: a second rounding; perplexity measured" in rows
    out = " ".join(result.output.split())  # rich wraps long lines
    assert f"shapes checked against {model}/config.json" in out
    assert "reference: the base model" in out
    assert "(held-out)" not in out and "as you chose them" in out


def test_check_refuses_the_group_size_without_traceback(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe("demo:tiny", [{"name": "g128", "stages": [
        {"quantize": {"method": "awq", "bits": 4, "group_size": 128}}]}])))
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert "group_size=128 does not divide the 64 inputs" in out and "Traceback" not in out
