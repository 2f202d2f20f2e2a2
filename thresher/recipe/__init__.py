"""The recipe schema: the one place that defines what a recipe may say.

A recipe names a base model, calibration and evaluation data, and variants; each variant is a
chain of stages (``prune`` or ``merge``, then ``quantize``). Unknown keys are errors, and every
error names the field path (``variants.1.stages.0.quantize.bits``) and what is wrong with it. A
``sweep`` section (a grid of prune and quantize options) is checked here, choice by choice, and
expanded into named variants by the flows (``thresher.flows.sweep``).

The modules, by what they hold: ``sources`` (text and the calibration/evaluation split),
``stages`` (stage types and variants), ``settings`` (publish, validate, tracking, execution),
``sweep`` (the grid), ``schema`` (the recipe and its plan), ``messages`` (validation errors)
and ``load`` (YAML in, a recipe out).
"""

from thresher.errors import RecipeError
from thresher.recipe.base import StrictModel
from thresher.recipe.load import load_recipe, parse_recipe, recipe_json_schema
from thresher.recipe.messages import format_validation_error
from thresher.recipe.schema import PlanStep, Recipe
from thresher.recipe.settings import (
    DEVICE_PATTERN,
    ExecutionConfig,
    GGUFTypeName,
    PublishConfig,
    TrackingConfig,
    ValidateConfig,
)
from thresher.recipe.sources import (
    HELDOUT_PERCENT,
    STDLIB_EXCLUDE,
    CalibrationConfig,
    EvalConfig,
    FilesSource,
    HFDatasetSource,
    PerplexityConfig,
    Split,
    TextSource,
    shared_text,
    stdlib_root,
    stdlib_split_of,
)
from thresher.recipe.stages import (
    AUTO_WIDTHS,
    QUANTIZE_STAGE,
    QUANTIZE_STAGES,
    AnyQuantizeStage,
    AWQStage,
    GPTQStage,
    MergeStage,
    NF4Stage,
    PruneStage,
    QuantizeStage,
    RTNStage,
    Stage,
    Variant,
    VariantValidate,
)
from thresher.recipe.sweep import SweepConfig, check_choice

__all__ = [
    "AUTO_WIDTHS", "DEVICE_PATTERN", "HELDOUT_PERCENT", "QUANTIZE_STAGE", "QUANTIZE_STAGES",
    "STDLIB_EXCLUDE", "AWQStage", "RecipeError", "AnyQuantizeStage", "CalibrationConfig", "EvalConfig",
    "ExecutionConfig", "FilesSource", "GGUFTypeName", "GPTQStage", "HFDatasetSource",
    "MergeStage", "NF4Stage", "PerplexityConfig", "PlanStep", "PruneStage", "PublishConfig",
    "QuantizeStage", "RTNStage", "Recipe", "Split", "Stage", "StrictModel", "SweepConfig",
    "TextSource", "TrackingConfig", "ValidateConfig", "Variant", "VariantValidate", "check_choice",
    "format_validation_error", "load_recipe", "parse_recipe", "recipe_json_schema",
    "shared_text", "stdlib_root", "stdlib_split_of",
]
