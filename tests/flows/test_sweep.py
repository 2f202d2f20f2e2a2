"""Sweep expansion: a recipe's grid as named variants after the hand-written ones, and the errors
that name the sweep's fields."""

import json

import pytest

from thresher.errors import RecipeError
from thresher.flows.sweep import parse_recipe


def sweep_recipe(sweep: dict, variants: list | None = None) -> dict:
    recipe = {"name": "s", "model": "demo:tiny", "sweep": sweep}
    if variants is not None:
        recipe["variants"] = variants
    return recipe


def test_sweep_expands_grid_after_hand_written_variants():
    recipe = parse_recipe(sweep_recipe(
        {"prune": {"method": "reap", "ratio": [0.25, 0.5]},
         "quantize": [{"method": "gptq", "bits": [3, 4]}, {"method": "awq", "bits": 4}]},
        variants=[{"name": "base", "stages": []}]))
    assert [v.name for v in recipe.variants] == [
        "base", "reap25-gptq3", "reap25-gptq4", "reap25-awq4",
        "reap50-gptq3", "reap50-gptq4", "reap50-awq4"]
    v = recipe.variants[5]
    assert v.stages[0].prune.ratio == 0.5 and v.stages[1].quantize.bits == 4
    assert recipe.sweep is None
    # each REAP model is one step, read by its three quantized children
    prunes = [s for s in recipe.plan() if s.stage.kind == "prune"]
    assert [len(s.variants) for s in prunes] == [3, 3]


def test_sweep_names_other_varying_keys_and_no_stage_choice():
    recipe = parse_recipe(sweep_recipe({"quantize": [
        None, {"method": "gptq", "group_size": [64, 128]}, {"method": "rtn", "group_size": 64}]}))
    assert [v.name for v in recipe.variants] == ["base", "gptq4-g64", "gptq4-g128", "rtn4-g64"]
    assert recipe.variants[0].stages == []


def test_sweep_round_trips_without_expanding_twice():
    recipe = parse_recipe(sweep_recipe({"prune": {"ratio": [0.25, 0.5]}}))
    dumped = recipe.model_dump(mode="json", by_alias=True)
    assert "sweep" not in dumped
    again = parse_recipe(json.loads(json.dumps(dumped)))
    assert again == recipe and len(again.variants) == 2


@pytest.mark.parametrize(
    "sweep, variants, words",
    [
        ({"quantize": {"method": ["gptq", "nf4"], "bits": [3, 4]}}, None,
         ["sweep.quantize:", "4-bit", "method=nf4, bits=3", "list of grids"]),
        ({"prune": {"ratio": [0.5, 1.5]}}, None, ["sweep.prune: ratio:", "(0, 1)"]),
        ({"quantize": {"method": "gptq", "bitz": 4}}, None, ["sweep.quantize: bitz: unknown key"]),
        ({"prune": {"ratio": [0.1, 0.2, 0.3]}, "quantize": {"method": "rtn", "bits": [2, 3, 4]},
          "max_variants": 8}, None, ["sweep:", "9 variants", "sweep.max_variants (8)"]),
        ({"prune": {"ratio": 0.5}}, [{"name": "reap50", "stages": []}],
         ["'reap50'", "already taken"]),
        ({"max_variants": 4}, None, ["sweep:", "at least one of 'prune' and 'quantize'"]),
        ({"prune": {"ratio": []}}, None, ["sweep.prune: ratio: an empty list"]),
    ],
)
def test_sweep_errors_name_the_field(sweep, variants, words):
    with pytest.raises(RecipeError) as err:
        parse_recipe(sweep_recipe(sweep, variants))
    for w in words:
        assert w in str(err.value), str(err.value)


def test_default_grid_limit_refuses_thousands():
    sweep = {"prune": {"ratio": [i / 100 for i in range(1, 41)]},
             "quantize": {"method": "rtn", "bits": [2, 3, 4, 8], "group_size": [32, 64, 128]}}
    with pytest.raises(RecipeError, match=r"480 variants, more than sweep.max_variants \(64\)"):
        parse_recipe(sweep_recipe(sweep))


def test_schema_keeps_the_sweep_until_the_flows_expand_it():
    """The recipe package checks a sweep but leaves it unexpanded: it dumps and reloads with the
    sweep, refuses to plan it, and ``expand_sweep`` gives what the flows' loader gives."""
    from thresher.flows.sweep import expand_sweep
    from thresher.recipe import parse_recipe as parse_document

    data = sweep_recipe({"prune": {"ratio": [0.25, 0.5]}}, variants=[{"name": "base", "stages": []}])
    document = parse_document(data)
    assert [v.name for v in document.variants] == ["base"] and document.sweep is not None
    dumped = document.model_dump(mode="json", by_alias=True)
    assert parse_document(json.loads(json.dumps(dumped))) == document
    with pytest.raises(ValueError, match="not expanded"):
        document.plan()
    expanded = expand_sweep(document)
    assert expanded == parse_recipe(data)
    assert [v.name for v in expanded.variants] == ["base", "reap25", "reap50"]
