"""The recipe: a base model, its data, its variants and its run settings, and the plan of the
stages to compute with equal prefixes shared."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from thresher.recipe.base import FieldError, StrictModel
from thresher.recipe.settings import ExecutionConfig, PublishConfig, TrackingConfig, ValidateConfig
from thresher.recipe.sources import CalibrationConfig, EvalConfig, shared_text
from thresher.recipe.stages import Stage, Variant
from thresher.recipe.sweep import SweepConfig


class Recipe(StrictModel):
    """A compression job: a base model and the variants to derive from it."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: str = Field(description="hub id, local directory, models:/name/version, demo:tiny|small")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    variants: list[Variant] = Field(default_factory=list, description="hand-written variants "
                                    "(a sweep appends its own)")
    publish: PublishConfig = Field(default_factory=PublishConfig)
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    sweep: SweepConfig | None = Field(
        None, description="a grid expanded into variants after the hand-written ones when the "
        "recipe runs (null once expanded: the variants hold the expansion)")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @model_serializer(mode="wrap")
    def _sweep_while_unexpanded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A sweep is dumped until the flows expand it; an expanded recipe dumps without one."""
        data = handler(self)
        if self.sweep is None:
            data.pop("sweep", None)
        return data

    @field_validator("variants")
    @classmethod
    def _unique_names(cls, variants: list[Variant]) -> list[Variant]:
        seen: set[str] = set()
        for v in variants:
            if v.name in seen:
                raise ValueError(f"variant name {v.name!r} is used twice")
            seen.add(v.name)
        return variants

    @model_validator(mode="after")
    def _some_variant(self) -> Recipe:
        if not self.variants and self.sweep is None:
            raise ValueError("a recipe needs at least one variant: list 'variants' or add a "
                             "'sweep'")
        uneven = [v.name for v in self.variants if v.per_layer_experts]
        if uneven and "gguf" in self.publish.formats:
            raise ValueError(f"publish.formats: gguf holds one expert count per model, and "
                             f"{', '.join(uneven)} prune with a 'damage' budget")
        return self

    @model_validator(mode="after")
    def _drafts_are_other_variants(self) -> Recipe:
        """A variant's draft is another variant of this recipe. Every variant derives from the
        same base by stages that keep the vocabulary and tokenizer, so the draft's proposals are
        in the target's tokens (the engine checks the vocabulary again when it loads both)."""
        names = [v.name for v in self.variants]
        for i, v in enumerate(self.variants):
            draft = v.validate_.draft if v.validate_ is not None else None
            if draft is None:
                continue
            path = f"variants.{i}.validate.draft"
            if draft == v.name:
                raise FieldError(path, f"variant {v.name!r} cannot be its own draft: a draft "
                                 "is another, cheaper variant of the same base")
            if draft not in names:
                raise FieldError(path, f"no variant named {draft!r} in this recipe (variants: "
                                 f"{', '.join(names)}); a draft shares the target's vocabulary "
                                 "only as a variant of the same base")
            if not self.validate_.enabled:
                raise FieldError(path, "drafts are scored by the validation run, and "
                                 "validate.enabled is false")
        if self.validate_.draft_of_base and not self.validate_.enabled:
            raise FieldError("validate.draft_of_base", "drafts are scored by the validation "
                             "run, and validate.enabled is false")
        return self

    @model_validator(mode="after")
    def _calibration_apart_from_evaluation(self) -> Recipe:
        if self.calibration.allow_eval_overlap:
            return self
        shared = shared_text(self.calibration.source, self.eval.perplexity.source)
        if shared is not None:
            raise ValueError(
                f"calibration.source and eval.perplexity.source both draw from {shared}, so the "
                "variants would be scored on text they were calibrated on; calibrate and evaluate "
                "on different files or dataset splits, or set calibration.allow_eval_overlap: "
                "true to accept it")
        return self

    def plan(self) -> list[PlanStep]:
        """The stages to compute, with equal prefixes shared across variants (of an expanded
        recipe: a sweep's variants are named and added by ``thresher.flows.sweep``)."""
        if self.sweep is not None:
            raise ValueError("the recipe's sweep is not expanded yet; plan the recipe that "
                             "thresher.flows.sweep.expand_sweep returns")
        steps: dict[tuple[str, ...], PlanStep] = {}
        for variant in self.variants:
            prefix: tuple[str, ...] = ()
            for stage in variant.stages:
                prefix = (*prefix, stage.model_dump_json(exclude_none=True))
                step = steps.get(prefix)
                if step is None:
                    parent = steps[prefix[:-1]].index if len(prefix) > 1 else None
                    step = PlanStep(index=len(steps), stage=stage, parent=parent)
                    steps[prefix] = step
                step.variants.append(variant.name)
        return list(steps.values())



class PlanStep(BaseModel):
    """One stage computation in the resolved plan; ``parent`` is the step whose output it reads."""

    index: int
    stage: Stage
    parent: int | None
    variants: list[str] = Field(default_factory=list)

