"""Validation messages: a pydantic error as one line per problem, naming the field path as a
recipe spells it (``variants.1.stages.0.quantize.bits``) or the command-line option that set it."""

from __future__ import annotations

from pydantic import ValidationError

from thresher.recipe.base import FieldError
from thresher.recipe.sources import SOURCE_FORMS
from thresher.recipe.stages import QUANTIZE_STAGES


def format_validation_error(err: ValidationError, where: str, as_options: bool = False) -> str:
    """The one message for a pydantic error: a heading naming ``where``, then one line per
    problem naming the field path (``variants.1.stages.0.quantize.bits``) or, ``as_options``,
    the command-line option (``--group-size``) of a command that builds a recipe section."""
    lines = [f"{where}: {'invalid options' if as_options else 'the recipe is invalid'}"]
    methods = ", ".join(QUANTIZE_STAGES)
    for e in err.errors():
        parts, method = readable_loc(e["loc"])
        error = e.get("ctx", {}).get("error")
        if isinstance(error, FieldError):
            parts = [*parts, *error.path.split(".")]
        if as_options:
            loc = "--" + "-".join(p.replace("_", "-") for p in parts) if parts else "(options)"
        else:
            loc = ".".join(parts).replace("validate_", "validate") or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and method is not None:
            msg = f"unknown key for method {method}{_owners(str(e['loc'][-1]))}"
        elif e["type"] == "extra_forbidden" and as_options:
            msg = f"not an option of {where}"
        elif e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see `thresher check --help`)"
        elif e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            msg = f"'method' must be one of {methods}"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def readable_loc(loc: tuple[int | str, ...]) -> tuple[list[str], str | None]:
    """The field path as a recipe spells it, and the quantize method it is under (if any):
    pydantic puts the unions' tags (``quantize.gptq.clip``, ``source.files.files``) and
    validator names in the path."""
    parts: list[str] = []
    method = None
    for i, p in enumerate(loc):
        if p == "function-after[_exactly_one(), Stage]":
            continue
        if i and loc[i - 1] == "quantize" and p in QUANTIZE_STAGES:
            method = str(p)
            continue
        if i and loc[i - 1] == "source" and p in SOURCE_FORMS:  # the form, not a field
            continue
        parts.append(str(p))
    return parts, method


def _owners(key: str) -> str:
    """Which methods have ``key``, for the error that refuses it under another method."""
    owners = [m for m, cls in QUANTIZE_STAGES.items() if key in cls.model_fields]
    if not owners:
        return " (check the spelling)"
    return f" (it belongs to method{'s' if len(owners) > 1 else ''} {' and '.join(owners)})"

