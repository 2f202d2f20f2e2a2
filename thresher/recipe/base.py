"""The base of every recipe section: a pydantic model that refuses unknown keys, and the error a
cross-section check raises to name the field it is about."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base for every recipe section: unknown keys are refused, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FieldError(ValueError):
    """A check of the whole recipe that is about one field deeper down: the message names
    ``path`` (``variants.2.validate.draft``) as a per-field check's would."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
