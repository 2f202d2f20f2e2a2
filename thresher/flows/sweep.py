"""Sweep expansion: a recipe's ``sweep`` grid as named variants after the hand-written ones.

The recipe package checks what a sweep says (every choice a valid stage, the grid within
``max_variants``); turning the choices into variants and naming them (``reap25-gptq3``,
``gptq4-g64``) is orchestration, done here when a recipe is loaded to run. ``load_recipe`` and
``parse_recipe`` are the recipe package's, followed by the expansion: every command and flow that
runs a recipe reads it through them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from thresher.errors import RecipeError
from thresher.recipe import PruneStage, QuantizeStage, Recipe, SweepConfig, check_choice
from thresher.recipe import load_recipe as load_document
from thresher.recipe import parse_recipe as parse_document
from thresher.recipe.sweep import StageGrid

# These keys always name a generated variant (reap25, gptq3); other keys only when their value
# differs between the sweep's choices for that stage (g64, actorder).
NAME_KEYS = {"prune": ("method", "ratio", "keep"),
             "quantize": ("method", "bits", "target_bits", "target_mb")}
_SHORT = {"group_size": "g", "keep_16bit": "keep16"}


def parse_recipe(data: Any, where: str = "recipe") -> Recipe:
    """Validate a parsed YAML/JSON document and expand its sweep, or raise RecipeError."""
    return expand_sweep(parse_document(data, where), where)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file and expand its sweep."""
    return expand_sweep(load_document(path), str(path))


def expand_sweep(recipe: Recipe, where: str = "recipe") -> Recipe:
    """The recipe with its sweep's variants appended and the sweep dropped, so it never expands
    twice; a recipe without a sweep comes back as it is. The result is validated again as a
    whole (unique names, formats that every variant can be published in)."""
    if recipe.sweep is None:
        return recipe
    taken = {v.name for v in recipe.variants}
    generated = sweep_variants(recipe.sweep)
    for v in generated:
        if v["name"] in taken:
            raise RecipeError(f"{where}: the recipe is invalid\n  sweep: the generated variant "
                              f"name {v['name']!r} is already taken (by a hand-written variant or "
                              "another choice); rename the hand-written variant or make the "
                              "choices differ")
        taken.add(v["name"])
    given = {k: getattr(recipe, k) for k in recipe.model_fields_set if k != "sweep"}
    return parse_document({**given, "variants": [*recipe.variants, *generated]}, where)


def sweep_variants(sweep: SweepConfig) -> list[dict[str, Any]]:
    """The grid as variant mappings (name and stages), prune choices outermost."""
    named = {kind: _named(kind, sweep.stage_choices(kind)) for kind in ("prune", "quantize")}
    out = []
    for prune_name, prune in named["prune"]:
        for quant_name, quant in named["quantize"]:
            stages = [{kind: opts} for kind, opts in (("prune", prune), ("quantize", quant))
                      if opts is not None]
            name = "-".join(n for n in (prune_name, quant_name) if n) or "base"
            out.append({"name": name, "stages": stages})
    return out


def _named(kind: str, choices: list[StageGrid | None]) -> list[tuple[str, StageGrid | None]]:
    """Each choice with its name part: the naming keys, then every other option whose value
    (given or default) differs between the choices."""
    stages = [None if c is None else check_choice(kind, c) for c in choices]
    present = [s for s in stages if s is not None]
    keys = dict.fromkeys(k for c in choices if c is not None for k in c)
    varying = [k for k in keys if k not in NAME_KEYS[kind]
               and len({repr(getattr(s, k, None)) for s in present}) > 1]
    out: list[tuple[str, StageGrid | None]] = []
    for choice, stage in zip(choices, stages, strict=True):
        if choice is None or stage is None:
            out.append(("", None))
            continue
        parts = [_main_name(stage)]
        parts += [_key_name(k, getattr(stage, k)) for k in varying if k in type(stage).model_fields]
        out.append(("-".join(parts), choice))
    return out


def _main_name(stage: PruneStage | QuantizeStage) -> str:
    if isinstance(stage, PruneStage):
        if stage.ratio is not None:
            return f"{stage.method}{stage.ratio * 100:g}"
        return f"{stage.method}-k{stage.keep}"
    if stage.method == "nf4":
        return "nf4"
    if stage.bits == "auto":
        target = getattr(stage, "target_bits", None)
        return f"{stage.method}-auto{target:g}" if target is not None else (
            f"{stage.method}-auto{stage.target_mb:g}mb")  # type: ignore[attr-defined]
    return f"{stage.method}{stage.bits}"


def _key_name(key: str, value: Any) -> str:
    short = _SHORT.get(key, key.replace("_", ""))
    if isinstance(value, bool):
        return short if value else f"no{short}"
    if isinstance(value, list):
        value = ".".join(map(str, value)) or "none"
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{short}{value:g}" if isinstance(value, float)
                  else f"{short}{value}")

