"""The ``sweep`` section: a grid of prune and quantize options, checked choice by choice.

This module holds what a sweep may say: its grids, the concrete choices a grid stands for (the
product of its list values) and the check of every choice as a stage. Naming the choices and
turning them into variants is the flows' work (``thresher.flows.sweep``).
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator

from thresher.recipe.base import StrictModel
from thresher.recipe.messages import readable_loc
from thresher.recipe.stages import QUANTIZE_STAGE, QUANTIZE_STAGES, PruneStage, QuantizeStage

StageGrid = dict[str, Any]
StageGrids = Annotated[
    StageGrid | list[StageGrid | None] | None,
    Field(description="a stage's options, where a list value is a grid axis "
          "({method: reap, ratio: [0.25, 0.5]}), or a list of such grids (null: no stage)"),
]


class SweepConfig(StrictModel):
    """A grid of variants: every choice of prune stage times every choice of quantize stage.

    The flows expand it into named variants after the hand-written ones and then drop it, so a
    recipe they run holds only concrete variants (and round-trips through JSON unchanged).
    """

    prune: StageGrids = None
    quantize: StageGrids = None
    max_variants: int = Field(64, gt=0, description="refuse a grid with more variants than this")

    @field_validator("prune", "quantize")
    @classmethod
    def _each_choice_valid(cls, grids: Any, info: Any) -> Any:
        for choice in _expand(info.field_name, grids):
            if choice is not None:
                check_choice(info.field_name, choice)
        return grids

    @model_validator(mode="after")
    def _bounded(self) -> SweepConfig:
        if self.prune is None and self.quantize is None:
            raise ValueError("a sweep names at least one of 'prune' and 'quantize'")
        count = len(self.stage_choices("prune")) * len(self.stage_choices("quantize"))
        if count > self.max_variants:
            raise ValueError(f"the grid makes {count} variants, more than sweep.max_variants "
                             f"({self.max_variants}); narrow the grid or raise sweep.max_variants")
        return self

    def stage_choices(self, kind: str) -> list[StageGrid | None]:
        """Every concrete option mapping of one stage kind (``[None]``: the sweep has no such stage)."""
        return _expand(kind, getattr(self, kind))


def _expand(kind: str, grids: Any) -> list[StageGrid | None]:
    """A grid (or list of grids) as its concrete choices: the product of its list values."""
    if grids is None:
        return [None]
    out: list[StageGrid | None] = []
    for grid in grids if isinstance(grids, list) else [grids]:
        if grid is None:
            out.append(None)
            continue
        axes = [[(k, x) for x in v] if _is_axis(kind, k, v) else [(k, v)] for k, v in grid.items()]
        for i, axis in enumerate(axes):
            if not axis:
                raise ValueError(f"{list(grid)[i]}: an empty list leaves nothing to sweep")
        out.extend(dict(combo) for combo in itertools.product(*axes))
    return out


def _is_axis(kind: str, key: str, value: Any) -> bool:
    """A list is an axis, except for a list-valued option (keep_16bit) where a list of lists is."""
    if not isinstance(value, list):
        return False
    if kind == "quantize" and key == "keep_16bit":
        return bool(value) and all(isinstance(x, list) for x in value)
    return True


def check_choice(kind: str, choice: StageGrid) -> PruneStage | QuantizeStage:
    """Validate one choice as its stage class, naming the option and the combination."""
    try:
        if kind == "prune":
            return PruneStage.model_validate(choice)
        return QUANTIZE_STAGE.validate_python(choice)
    except ValidationError as err:
        combo = ", ".join(f"{k}={v}" for k, v in choice.items())
        problems = []
        for e in err.errors():
            parts, _ = readable_loc((kind, *e["loc"]))
            field = ".".join(parts[1:])
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == "extra_forbidden":
                msg = "unknown key" + (f" for method {choice.get('method')}" if kind == "quantize"
                                       else "")
            elif e["type"] in ("union_tag_invalid", "union_tag_not_found"):
                msg = f"'method' must be one of {', '.join(QUANTIZE_STAGES)}"
            problems.append(f"{field}: {msg}" if field else msg)
        hint = ("; give each method its own grid in a list of grids" if kind == "quantize"
                and isinstance(choice.get("method"), str) else "")
        raise ValueError(f"{'; '.join(problems)} (in the choice {combo}{hint})") from None
