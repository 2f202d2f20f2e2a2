"""The base of every recipe section: a pydantic model that refuses unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base for every recipe section: unknown keys are refused, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
