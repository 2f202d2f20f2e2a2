"""Reading a recipe: YAML or a parsed document in, a validated ``Recipe`` or a ``RecipeError``
naming every wrong field out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from thresher.errors import RecipeError
from thresher.recipe.messages import format_validation_error
from thresher.recipe.schema import Recipe


def parse_recipe(data: Any, where: str = "recipe") -> Recipe:
    """Validate a parsed YAML/JSON document into a Recipe, or raise RecipeError naming fields."""
    if data is None:
        raise RecipeError(f"{where}: the recipe is empty; `thresher demo --print-recipe` prints "
                          "one to start from")
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a mapping of keys to values, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, where)) from None


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{path}: a directory, not a recipe file")
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not a text file (byte {err.start} is not UTF-8); a recipe "
                          "is YAML") from None
    except OSError as err:
        raise RecipeError(f"{path}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    return parse_recipe(data, where=str(path))


def recipe_json_schema() -> dict[str, Any]:
    """JSON schema of a recipe (for editors and the Prefect UI's parameter form)."""
    return Recipe.model_json_schema(by_alias=True)
