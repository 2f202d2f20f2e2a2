"""The recipe schema: the one place that defines what a recipe may say.

A recipe names a base model, calibration and evaluation data, and variants; each variant is a
chain of stages (``prune`` then ``quantize``). Unknown keys are errors, and every error names the
field path (``variants.1.stages.0.quantize.bits``) and what is wrong with it. A ``sweep`` section
(a grid of prune and quantize options) expands into more variants during validation.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import re
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from thresher.errors import RecipeError


class StrictModel(BaseModel):
    """Base for every recipe section: unknown keys are refused, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --- text sources -------------------------------------------------------------------------------


class HFDatasetSource(StrictModel):
    """A Hugging Face dataset (hub name or a local dataset script/dir)."""

    hf: str = Field(description="dataset name, e.g. 'wikitext' or 'allenai/c4'")
    config: str | None = Field(None, description="dataset configuration, e.g. 'wikitext-2-raw-v1'")
    split: str = "train"
    field: str = Field("text", description="column that holds the text")


class FilesSource(StrictModel):
    """Local files: paths or globs of .txt, .py, .md or .jsonl files."""

    files: list[str] = Field(min_length=1)
    field: str = Field("text", description="key that holds the text in .jsonl records")


Split = Literal["train", "heldout"]

# Tests, IDLE and bundled third-party code are not "the standard library's source" in any useful
# sense and would make the corpus depend on how Python was packaged.
STDLIB_EXCLUDE = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
                  "__pycache__")
HELDOUT_PERCENT = 10


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_split_of(relpath: str) -> Split:
    """The split a standard-library file belongs to: a stable hash of its relative path.

    It lives beside the schema because it is what ``stdlib`` means (calibration reads the train
    split, evaluation the held-out one) and what the overlap check below compares files against."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def _stdlib_split_of_file(path: Path) -> Split | None:
    """The ``stdlib`` split that reads ``path``; None when the corpus does not hold it."""
    root = stdlib_root().resolve()
    if path.suffix != ".py" or not path.is_relative_to(root):
        return None
    rel = path.relative_to(root).as_posix()
    if any(part in STDLIB_EXCLUDE for part in rel.split("/")[:-1]):
        return None
    return stdlib_split_of(rel)


TextSource = Annotated[
    Literal["stdlib"] | HFDatasetSource | FilesSource,
    Field(
        description="'stdlib' (the Python standard library's source; calibration uses its train "
        "split, evaluation its held-out split), {hf: ...} or {files: [...]}"
    ),
]


class CalibrationConfig(StrictModel):
    """The text that pruning and quantization observe."""

    source: TextSource = "stdlib"
    samples: int = Field(128, gt=0, description="number of calibration windows")
    seq_len: int = Field(256, gt=0, description="tokens per window")
    seed: int = 0
    allow_eval_overlap: bool = Field(
        False, description="accept calibration text that evaluation also scores (the same local "
        "files, the same dataset split, or files of the stdlib held-out split): the recipe is "
        "refused without it, because every variant's perplexity would flatter it. Not part of "
        "a stage's store key: it changes no artifact")


class PerplexityConfig(StrictModel):
    """Token-level perplexity on non-overlapping windows of held-out text."""

    source: TextSource = "stdlib"
    seq_len: int = Field(256, gt=0)
    max_windows: int | None = Field(64, gt=0, description="cap on windows scored (null: all)")
    batch_size: int = Field(8, gt=0)


class EvalConfig(StrictModel):
    """How every variant is scored: held-out perplexity, optionally lm-evaluation-harness tasks."""

    perplexity: PerplexityConfig = Field(default_factory=PerplexityConfig)
    tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness task names")
    task_limit: int | None = Field(None, gt=0, description="cap on documents per task")


# --- stages -------------------------------------------------------------------------------------


class PruneStage(StrictModel):
    """Expert pruning: remove the lowest-saliency experts in every MoE layer."""

    method: Literal["reap", "frequency", "ean", "weighted_ean", "auto", "random"] = Field(
        "reap", description="saliency criterion; 'auto' keeps, per layer, the candidate set "
        "(every criterion's and a greedy search's) whose removal changes the MoE block's output "
        "least on held-out calibration windows")
    ratio: float | None = Field(None, description="fraction of experts removed per layer, in (0, 1)")
    keep: int | None = Field(None, gt=0, description="number of experts kept per layer")
    seed: int = Field(0, description="seed of the 'random' control")
    budget: Literal["uniform", "damage"] = Field(
        "uniform", description="'uniform': every layer loses the same number of experts; "
        "'damage': the same total split across layers by measured local error (per-layer expert "
        "counts differ: thresher loads such a checkpoint, quantization and serving do not yet)")
    min_keep_fraction: float = Field(
        0.25, gt=0.0, le=1.0,
        description="'damage' budget: no layer keeps fewer than this fraction of its experts")
    protect_super_experts: bool = Field(
        False, description="never remove experts whose output carries extreme outliers "
        "(the REAP reference's super experts)")
    heldout_fraction: float = Field(
        0.25, gt=0.0, lt=1.0,
        description="'auto' and 'damage': share of the calibration windows held out from saliency "
        "to measure local errors on")
    probe_tokens: int = Field(
        4096, gt=0, description="'auto' and 'damage': tokens per layer (of the saliency and of the "
        "held-out windows) on which every expert's output is kept to measure local errors")
    damage: Literal["local", "loss"] = Field(
        "local", description="what 'auto' and the 'damage' budget minimize: 'local', the MoE "
        "block's reconstruction error; 'loss', the increase of the model's next-token loss on the "
        "held-out windows when only that layer is pruned (runs the layers after it per candidate)")
    sequential: bool = Field(
        False, description="damage 'loss': choose layer by layer in order, measuring each "
        "layer's candidates (and, with the 'damage' budget, removal counts) with the earlier "
        "layers already pruned as chosen")
    loss_tokens: int = Field(
        8192, gt=0, description="damage 'loss': held-out tokens (whole windows, at least one) the "
        "loss is measured on")
    refit: bool = Field(
        False, description="after choosing the experts, refit the kept experts' down projections "
        "(ridge least squares on the calibration tokens) so the pruned MoE block reproduces the "
        "unpruned block's output; the checkpoint's architecture is unchanged")
    refit_damp: float = Field(
        0.01, gt=0.0, description="refit: ridge strength toward the original weights, relative to "
        "the mean diagonal of each expert's Gram matrix")
    refit_target: Literal["model", "block"] = Field(
        "model", description="refit: fit each pruned block so that the layer's output matches "
        "the unpruned model's at that depth ('model': also corrects what earlier pruned layers "
        "changed; walks a second stream of activations), or to the unpruned block on the same "
        "inputs ('block')")
    refit_tokens: int = Field(
        65536, gt=0, description="refit: calibration tokens per MoE layer the refit is fitted on")

    @field_validator("ratio")
    @classmethod
    def _ratio_in_range(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v < 1.0:
            raise ValueError(f"ratio must be in (0, 1), got {v}")
        return v

    @model_validator(mode="after")
    def _ratio_or_keep(self) -> PruneStage:
        if (self.ratio is None) == (self.keep is None):
            raise ValueError("give exactly one of 'ratio' and 'keep'")
        if self.method == "random" and (self.budget != "uniform" or self.protect_super_experts):
            raise ValueError("the 'random' control observes nothing: it takes budget 'uniform' "
                             "and no protect_super_experts")
        if self.sequential and self.damage != "loss":
            raise ValueError("sequential measures the model's loss with earlier layers pruned; "
                             "it takes damage 'loss'")
        unread = [name for name in ("refit_damp", "refit_target", "refit_tokens")
                  if getattr(self, name) != type(self).model_fields[name].default]
        if unread and not self.refit:
            raise ValueError(f"{', '.join(unread)} set without refit: true, which is what reads "
                             "them")
        if self.damage != "local" and self.method != "auto" and self.budget != "damage":
            raise ValueError(f"damage {self.damage!r} is what 'auto' and the 'damage' budget "
                             f"minimize; method {self.method!r} with budget 'uniform' reads no "
                             "damage (use method 'auto' or budget 'damage')")
        return self

    def describe(self) -> str:
        amount = f"ratio={self.ratio}" if self.ratio is not None else f"keep={self.keep}"
        extra = "" if self.budget == "uniform" else f" budget={self.budget}"
        extra += "" if self.damage == "local" else f" damage={self.damage}"
        extra += " sequential" if self.sequential else ""
        extra += " protect_super_experts" if self.protect_super_experts else ""
        extra += (" refit" + ("" if self.refit_target == "model" else f"({self.refit_target})")
              if self.refit else "")
        return f"prune {self.method} {amount}{extra}"


class MergeStage(StrictModel):
    """Expert merging: replace each MoE layer's experts by fewer, frequency-weighted averages of
    groups of them (the REAP paper's merging baselines; docs/pruning.md, "Merging")."""

    method: Literal["m_smoe", "hc_smoe"] = Field(
        "hc_smoe", description="'m_smoe': the most used experts lead groups, every other expert "
        "joins the leader whose router logits it resembles most; 'hc_smoe': hierarchical "
        "clustering of the experts' mean outputs on the calibration tokens")
    ratio: float | None = Field(None, gt=0.0, lt=1.0,
                                description="fraction of experts merged away per layer, in (0, 1)")
    keep: int | None = Field(None, gt=0, description="experts (groups) kept per layer; the expert "
                             "count itself merges every expert with itself (a no-op)")
    router: Literal["leader", "average"] = Field(
        "leader", description="the merged expert's router row: its most used member's "
        "('leader') or the frequency-weighted average of its members' rows ('average')")
    permute: bool | None = Field(
        None, description="align each member's intermediate neurons to its leader's (weight "
        "matching) before averaging; default: on for m_smoe, off for hc_smoe, as in the papers")
    linkage: Literal["average", "single", "complete"] = Field(
        "average", description="hc_smoe: how the distance between two clusters of experts is "
        "measured")

    @model_validator(mode="after")
    def _ratio_or_keep(self) -> MergeStage:
        if (self.ratio is None) == (self.keep is None):
            raise ValueError("give exactly one of 'ratio' and 'keep'")
        if self.method != "hc_smoe" and self.linkage != "average":
            raise ValueError(f"linkage is hc_smoe's clustering; method {self.method!r} groups "
                             "experts around their leaders")
        return self

    @property
    def aligns(self) -> bool:
        """Whether members are permuted onto their leader before averaging."""
        return self.method == "m_smoe" if self.permute is None else self.permute

    def describe(self) -> str:
        amount = f"ratio={self.ratio}" if self.ratio is not None else f"keep={self.keep}"
        extra = "" if self.router == "leader" else f" router={self.router}"
        extra += "" if self.permute is None else f" permute={self.permute}"
        extra += "" if self.linkage == "average" else f" linkage={self.linkage}"
        return f"merge {self.method} {amount}{extra}"


class QuantizeStage(StrictModel):
    """Weight quantization of the decoder layers' linear and expert weights: the shared knobs.

    A recipe's ``quantize`` section is one of the per-method subclasses below, chosen by
    ``method``; each holds only the knobs its method reads, so a knob of another method is an
    unknown key. ``QuantizeStage(method="gptq", ...)`` builds the ``GPTQStage``, so code names the
    method the way a recipe does.
    """

    method: str
    bits: Literal[2, 3, 4, 8, "auto"] = Field(
        4, description="bit width; 'auto' (gptq): per-matrix widths chosen under target_bits or "
        "target_mb")
    group_size: int = Field(128, description="-1 = one group per output row")
    keep_16bit: list[str] = Field(
        default_factory=lambda: ["router", "embeddings", "lm_head"],
        description="parts that stay in 16 bits",
    )

    def __new__(cls, *args: Any, **data: Any) -> QuantizeStage:
        if cls is QuantizeStage:
            method = data.get("method")
            if not isinstance(method, str) or method not in QUANTIZE_STAGES:
                QUANTIZE_STAGE.validate_python(data)  # raises, naming the methods there are
            cls = QUANTIZE_STAGES[method]
        return super().__new__(cls)

    auto_bits: ClassVar[bool] = False  # whether the method can choose widths per matrix

    @field_validator("bits")
    @classmethod
    def _auto_supported(cls, v: int | str) -> int | str:
        if v == "auto" and not cls.auto_bits:
            raise ValueError("'auto' (mixed precision under a budget) is supported by method gptq")
        return v

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        if v != -1 and (v <= 0 or v % 8):
            raise ValueError(f"group_size must be -1 or a positive multiple of 8, got {v}")
        return v

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> QuantizeStage:
        """Pydantic's copy (no validation), except that an update naming another method gives
        that method's stage: the shared knobs set here carry over, its own knobs take its
        defaults. Knobs the method does not have are kept aside for ``check_stage`` to refuse."""
        target = QUANTIZE_STAGES.get((update or {}).get("method", self.method), type(self))
        if target is type(self):
            return super().model_copy(update=update, deep=deep)
        carried = {k: getattr(self, k) for k in self.model_fields_set if k in target.model_fields}
        return target.model_construct(**carried).model_copy(update=update, deep=deep)

    def describe(self) -> str:
        return f"quantize {self.method} {self.bits}-bit g{self.group_size}"

    @property
    def uniform_bits(self) -> int:
        """The one width of every matrix (refused for ``bits: auto``, whose widths differ)."""
        if self.bits == "auto":
            raise ValueError("bits 'auto' has no single width")
        return int(self.bits)


class RTNStage(QuantizeStage):
    """Round-to-nearest on a min-max grid: no calibration data; written in the GPTQ format."""

    model_config = ConfigDict(title="rtn")  # the choice's label in the Prefect run form

    method: Literal["rtn"] = "rtn"
    sym: bool = Field(False, description="symmetric grid")
    scale_search: Literal["minmax", "mse"] = Field(
        "minmax", description="group scales: min-max range, or the shrunk range of least "
        "squared weight error (GPTQ's mse grid search)"
    )


AUTO_WIDTHS = (2, 3, 4, 8)  # bits auto: the candidate widths unless the stage names others


class GPTQStage(QuantizeStage):
    """GPTQ: Hessian-compensated rounding, column by column; written in the GPTQ format."""

    model_config = ConfigDict(title="gptq")  # the choice's label in the Prefect run form

    method: Literal["gptq"] = "gptq"
    sym: bool = Field(True, description="symmetric grid")
    act_order: bool = Field(False, description="quantize columns by descending Hessian diag")
    static_groups: bool = Field(
        True, description="with act_order: fit groups up front so the checkpoint keeps desc_act "
        "false (vLLM refuses desc_act true)"
    )
    damp_percent: float = Field(0.01, gt=0.0, lt=1.0, description="Hessian dampening")
    block_size: int = Field(128, gt=0, description="lazy-update block")
    min_expert_tokens: int = Field(
        8, ge=0, description="experts with fewer effective (gate-weighted) calibration tokens "
        "fall back to RTN"
    )
    rare_expert_damping: bool = Field(
        True, description="raise an expert's dampening by columns / effective tokens, so a "
        "Hessian seen on few tokens moves GPTQ toward RTN instead of overfitting them"
    )
    expert_tokens: Literal["routed", "all"] = Field(
        "routed", description="calibrate each expert on its routed tokens or on every token, "
        "unweighted (llm-compressor's moe_calibrate_all_experts)"
    )
    expert_weighting: Literal["auto", "once", "gate"] = Field(
        "auto", description="routed tokens in an expert's Hessian: each counted once (as "
        "AutoGPTQ and llm-compressor do), weighted by its gate squared (its weight in the layer "
        "output's squared error), or auto: gate at 2 bits, once at wider widths (once won at 3 "
        "bits and lost at 2 on both demo models)"
    )
    scale_search: Literal["minmax", "mse"] = Field(
        "minmax", description="group scales: min-max range, or the shrunk range of least "
        "squared weight error (GPTQ's mse grid search)"
    )
    target_bits: float | None = Field(
        None, gt=0, description="bits 'auto': average code bits per quantized weight (weighted by "
        "weight count; scales and zeros come on top, as at a uniform width)")
    target_mb: float | None = Field(
        None, gt=0, description="bits 'auto': size of the whole checkpoint's tensors in MiB")
    # None (the default) keeps the store keys of uniform-width stages as they were.
    candidate_bits: list[Literal[2, 3, 4, 8]] | None = Field(
        None, description="bits 'auto': widths a matrix may get (default 2, 3, 4, 8)")
    sensitivity: Literal["gptq", "rtn"] | None = Field(
        None, description="bits 'auto': each width's damage measured after plain rounding "
        "(default, 'rtn': one Hessian pass) or after GPTQ at this stage's settings ('gptq': one "
        "GPTQ run per candidate width)")

    auto_bits: ClassVar[bool] = True

    @property
    def auto_widths(self) -> list[int]:
        """``bits: auto``: the candidate widths, narrowest first."""
        return sorted(self.candidate_bits or AUTO_WIDTHS)

    @model_validator(mode="after")
    def _auto_targets(self) -> GPTQStage:
        auto_only = ("target_bits", "target_mb", "candidate_bits", "sensitivity")
        given = [f for f in auto_only if getattr(self, f) is not None]
        if self.bits != "auto":
            if given:
                raise ValueError(f"{given[0]} applies only with bits: auto")
            return self
        if len([f for f in given if f.startswith("target_")]) != 1:
            raise ValueError("bits: auto needs exactly one of target_bits and target_mb")
        widths = self.auto_widths
        if len(widths) < 2 or len(set(widths)) != len(widths):
            raise ValueError(f"candidate_bits must list at least two different widths, got "
                             f"{self.candidate_bits}")
        tb = self.target_bits
        if tb is not None and not widths[0] <= tb <= widths[-1]:
            raise ValueError(f"target_bits={tb} is outside candidate_bits {widths}: no allocation "
                             "can average it")
        return self

    def describe(self) -> str:
        base = super().describe()
        if self.bits == "auto":
            target = (f"{self.target_bits:g}-bit" if self.target_bits is not None
                      else f"{self.target_mb:g}MB")
            base = f"quantize gptq auto {target} g{self.group_size}"
        return (base + (" act-order" if self.act_order else "")
                + (" mse" if self.scale_search == "mse" else ""))


class AWQStage(QuantizeStage):
    """AWQ: activation-aware input-channel scaling, then RTN; 4-bit written in the AWQ gemm
    format, 2, 3 and 8 bits in the GPTQ format (the scales are folded into the weights)."""

    model_config = ConfigDict(title="awq")  # the choice's label in the Prefect run form

    method: Literal["awq"] = "awq"
    sym: bool = Field(False, description="symmetric grid")
    duo_scaling: bool = Field(True, description="s = x^a / w^(1-a)")
    clip: bool = Field(True, description="search weight clipping ranges (as both reference "
                       "implementations do by default)")
    min_expert_tokens: int = Field(
        8, ge=0, description="experts with fewer effective (gate-weighted) calibration tokens are "
        "left unscaled and unclipped"
    )
    expert_tokens: Literal["routed", "all"] = Field(
        "routed", description="calibrate each expert on its routed tokens (gate-weighted) or on "
        "every token, unweighted (llm-compressor's moe_calibrate_all_experts)"
    )
    select_on: Literal["fit", "heldout"] = Field(
        "fit", description="judge the scale (alpha) and clip candidates on the tokens they are "
        "computed from, or split the calibration batches: fit on the even ones, choose on the odd"
    )


class NF4Stage(QuantizeStage):
    """NF4 (bitsandbytes): normal-quantile codes in blocks of 64; no calibration data."""

    model_config = ConfigDict(title="nf4")  # the choice's label in the Prefect run form

    method: Literal["nf4"] = "nf4"
    double_quant: bool = Field(False, description="quantize the absmax constants too")
    compute_dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16"

    @model_validator(mode="after")
    def _four_bits(self) -> NF4Stage:
        if self.bits != 4:
            raise ValueError("nf4 is a 4-bit format; set bits: 4")
        return self

    def describe(self) -> str:
        return "quantize nf4" + (" double-quant" if self.double_quant else "")


QUANTIZE_STAGES: dict[str, type[QuantizeStage]] = {
    "rtn": RTNStage, "gptq": GPTQStage, "awq": AWQStage, "nf4": NF4Stage,
}
AnyQuantizeStage = Annotated[RTNStage | GPTQStage | AWQStage | NF4Stage,
                             Field(discriminator="method")]
QUANTIZE_STAGE: TypeAdapter[QuantizeStage] = TypeAdapter(AnyQuantizeStage)


def _quantize_choices(schema: dict[str, Any]) -> None:
    """Spell the quantize union as a flat ``anyOf`` of the methods' stages and null.

    Prefect's run form draws an ``anyOf`` as a choice between sub-forms but knows neither
    ``oneOf`` nor ``discriminator``; each method's stage pins ``method`` to its constant, so a
    value matches one choice at most and the two spellings accept the same documents.
    """
    options = schema["properties"]["quantize"]["anyOf"]
    union = next(o for o in options if "oneOf" in o)
    schema["properties"]["quantize"]["anyOf"] = [*union["oneOf"], {"type": "null"}]


class Stage(StrictModel):
    """One step of a variant: exactly one of ``prune``, ``merge`` or ``quantize``."""

    model_config = ConfigDict(json_schema_extra=_quantize_choices)

    prune: PruneStage | None = None
    merge: MergeStage | None = None
    quantize: AnyQuantizeStage | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Stage:
        if sum(s is not None for s in (self.prune, self.merge, self.quantize)) != 1:
            raise ValueError("a stage holds exactly one of 'prune', 'merge' or 'quantize'")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("prune", "merge", "quantize") if getattr(self, k) is not None)

    @property
    def options(self) -> PruneStage | MergeStage | QuantizeStage:
        return getattr(self, self.kind)

    def describe(self) -> str:
        return self.options.describe()


class Variant(StrictModel):
    """One model to derive from the base: its name and its chain of stages (none: the base)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    stages: list[Stage] = Field(default_factory=list)

    @field_validator("stages")
    @classmethod
    def _order(cls, stages: list[Stage]) -> list[Stage]:
        kinds = [s.kind for s in stages]
        if kinds.count("quantize") > 1:
            raise ValueError("a variant has at most one quantize stage")
        if "quantize" in kinds and {"prune", "merge"} & set(kinds[kinds.index("quantize") :]):
            raise ValueError("prune and merge stages come before the quantize stage")
        return stages

    @property
    def per_layer_experts(self) -> bool:
        """Whether the variant's layers keep different numbers of experts ('damage' budget):
        thresher quantizes, evaluates and serves such a checkpoint; plain transformers, vLLM and
        GGUF (llama.cpp) hold one expert count per model and cannot load it."""
        return any(s.prune is not None and s.prune.budget == "damage" for s in self.stages)


# --- publish, validate, tracking ----------------------------------------------------------------


GGUFTypeName = Literal["f32", "f16", "bf16", "q8_0", "q6_k", "q5_0", "q4_1", "q4_0", "q4_k",
                       "q4_k_m", "q3_k", "q3_k_m"]  # the names of thresher.export.gguf.GGUF_TYPES


class PublishConfig(StrictModel):
    """Where each variant is published, and under which MLflow registered model name."""

    registry_name: str | None = Field(None, description="MLflow registered model name")
    dir: str | None = Field(None, description="publish location (default: the state directory)")
    formats: list[Literal["hf", "gguf"]] = Field(
        default_factory=lambda: ["hf"], description="hf: the checkpoint (always); gguf: GGUF "
        "files for llama.cpp and Ollama beside it, logged to the variant's run")
    gguf_types: list[GGUFTypeName] = Field(
        default_factory=lambda: ["q8_0"], min_length=1, description="GGUF types of a 16-bit "
        "variant; a GPTQ/AWQ variant with group size 32 is handed to q4_1 as it is")
    gguf_imatrix: bool = Field(False, description="weight the GGUF rounding by an importance "
                               "matrix from the recipe's calibration windows")
    gguf_gptq: bool = Field(False, description="round the GGUF blocks by GPTQ against each "
                            "matrix's Hessian on the recipe's calibration windows (scales from "
                            "the importance-weighted fit)")

    @model_validator(mode="after")
    def _hf_always(self) -> PublishConfig:
        if "hf" not in self.formats:
            raise ValueError("formats must include hf: the registry and the validation read the "
                             "checkpoint; add gguf next to it")
        return self


class ValidateConfig(StrictModel):
    """The serving engine's check of every variant: agreement with the base and a load test."""

    enabled: bool = True
    concurrency: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1, 4, 16])
    max_tokens: int = Field(64, gt=0, description="tokens generated per agreement prompt and "
                            "per load-test request")
    rounds: int = Field(2, gt=0, description="requests each load-test client sends in turn")


class TrackingConfig(StrictModel):
    """Where the MLflow runs go."""

    mlflow_uri: str | None = Field(None, description="default: $MLFLOW_TRACKING_URI, else SQLite")
    experiment: str | None = Field(None, description="default: the recipe name")


# --- sweeps and execution -----------------------------------------------------------------------

StageGrid = dict[str, Any]
StageGrids = Annotated[
    StageGrid | list[StageGrid | None] | None,
    Field(description="a stage's options, where a list value is a grid axis "
          "({method: reap, ratio: [0.25, 0.5]}), or a list of such grids (null: no stage)"),
]
# Naming: these keys always name a generated variant (reap25, gptq3); other keys only when their
# value differs between the sweep's choices for that stage (g64, actorder).
_NAME_KEYS = {"prune": ("method", "ratio", "keep"),
              "quantize": ("method", "bits", "target_bits", "target_mb")}
_SHORT = {"group_size": "g", "keep_16bit": "keep16"}


class SweepConfig(StrictModel):
    """A grid of variants: every choice of prune stage times every choice of quantize stage.

    ``Recipe`` expands it into named variants after the hand-written ones and then drops it, so a
    validated recipe holds only concrete variants (and round-trips through JSON unchanged).
    """

    prune: StageGrids = None
    quantize: StageGrids = None
    max_variants: int = Field(64, gt=0, description="refuse a grid with more variants than this")

    @field_validator("prune", "quantize")
    @classmethod
    def _each_choice_valid(cls, grids: Any, info: Any) -> Any:
        for choice in _expand(info.field_name, grids):
            if choice is not None:
                _check_stage(info.field_name, choice)
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

    def variants(self) -> list[dict[str, Any]]:
        """The grid as variant mappings (name and stages), prune choices outermost."""
        named = {kind: _named(kind, self.stage_choices(kind)) for kind in ("prune", "quantize")}
        out = []
        for prune_name, prune in named["prune"]:
            for quant_name, quant in named["quantize"]:
                stages = [{kind: opts} for kind, opts in (("prune", prune), ("quantize", quant))
                          if opts is not None]
                name = "-".join(n for n in (prune_name, quant_name) if n) or "base"
                out.append({"name": name, "stages": stages})
        return out


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


def _check_stage(kind: str, choice: StageGrid) -> PruneStage | QuantizeStage:
    """Validate one choice as its stage class, naming the option and the combination."""
    try:
        if kind == "prune":
            return PruneStage.model_validate(choice)
        return QUANTIZE_STAGE.validate_python(choice)
    except ValidationError as err:
        combo = ", ".join(f"{k}={v}" for k, v in choice.items())
        problems = []
        for e in err.errors():
            parts, _ = _readable_loc((kind, *e["loc"]))
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


def _named(kind: str, choices: list[StageGrid | None]) -> list[tuple[str, StageGrid | None]]:
    """Each choice with its name part: the naming keys, then every other option whose value
    (given or default) differs between the choices."""
    stages = [None if c is None else _check_stage(kind, c) for c in choices]
    present = [s for s in stages if s is not None]
    keys = dict.fromkeys(k for c in choices if c is not None for k in c)
    varying = [k for k in keys if k not in _NAME_KEYS[kind]
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


DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"  # what --device and execution.device accept


class ExecutionConfig(StrictModel):
    """Where the variants run: in this process (default) or fanned out over a Prefect work pool,
    and on which device their prune and quantize stages compute.

    The device is an execution setting like the work pool, not part of a stage's store key: the
    stages agree on the CPU and a GPU up to floating-point order, so an artifact computed on one
    serves a recipe that names the other.
    """

    work_pool: str | None = Field(None, description="Prefect work pool whose workers run the "
                                  "variants (one flow run per group sharing a first stage)")
    device: str = Field("auto", pattern=DEVICE_PATTERN,
                        description="where prune and quantize compute: 'auto' (CUDA when "
                        "available, else the CPU), 'cpu', 'cuda' or 'cuda:N'")
    offload_budget_gb: float | None = Field(
        None, ge=0, description="calibration activations kept on the device (GiB); the rest "
        "wait in pinned host memory (default: half the device's free memory; 0: all offloaded)")
    retries: int = Field(2, ge=0, description="resubmissions of a variant group whose flow run "
                         "ends FAILED or CRASHED (a lost worker)")
    poll_seconds: float = Field(5.0, gt=0, description="how often the parent polls the runs")


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
        None, exclude=True, description="a grid expanded into variants after the hand-written "
        "ones (always null once validated: the variants hold the expansion)")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _expand_sweep(cls, data: Any) -> Any:
        """Append the sweep's variants and drop the sweep, so it never expands twice. An invalid
        sweep is left in place for the ``sweep`` field to report, naming its fields."""
        if not isinstance(data, dict) or data.get("sweep") is None:
            return data
        raw = data["sweep"]
        try:
            sweep = raw if isinstance(raw, SweepConfig) else SweepConfig.model_validate(raw)
        except ValidationError:
            return data
        hand = list(data.get("variants") or [])
        taken = {v.name if isinstance(v, Variant) else v.get("name") for v in hand
                 if isinstance(v, Variant | dict)}
        generated = sweep.variants()
        for v in generated:
            if v["name"] in taken:
                raise ValueError(f"sweep: the generated variant name {v['name']!r} is already "
                                 "taken (by a hand-written variant or another choice); rename "
                                 "the hand-written variant or make the choices differ")
            taken.add(v["name"])
        return {**data, "variants": hand + generated, "sweep": None}

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
        if not self.variants:
            raise ValueError("a recipe needs at least one variant: list 'variants' or add a "
                             "'sweep'")
        uneven = [v.name for v in self.variants if v.per_layer_experts]
        if uneven and "gguf" in self.publish.formats:
            raise ValueError(f"publish.formats: gguf holds one expert count per model, and "
                             f"{', '.join(uneven)} prune with a 'damage' budget")
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
        """The stages to compute, with equal prefixes shared across variants."""
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


def shared_text(calibration: Any, evaluation: Any) -> str | None:
    """What a calibration source and an evaluation source both read, described (None: nothing).

    ``stdlib`` against itself is apart by its hash split; local files are compared by their
    resolved paths (and against the stdlib split the other side reads); datasets by name,
    configuration and split.
    """
    if isinstance(calibration, HFDatasetSource) and isinstance(evaluation, HFDatasetSource):
        same = (calibration.hf, calibration.config, calibration.split) == (
            evaluation.hf, evaluation.config, evaluation.split)
        return (f"dataset {calibration.hf!r} (config {calibration.config!r}, split "
                f"{calibration.split!r})") if same else None
    cal_files, eval_files = _named_files(calibration), _named_files(evaluation)
    both = sorted(cal_files & eval_files)
    if evaluation == "stdlib":
        both = [f for f in sorted(cal_files) if _stdlib_split_of_file(Path(f)) == "heldout"]
    elif calibration == "stdlib":
        both = [f for f in sorted(eval_files) if _stdlib_split_of_file(Path(f)) == "train"]
    if not both:
        return None
    split = (" (of the stdlib held-out split)" if evaluation == "stdlib" else
             " (of the stdlib train split)" if calibration == "stdlib" else "")
    more = f" and {len(both) - 3} more" if len(both) > 3 else ""
    return f"the local file{'s' if len(both) > 1 else ''} {', '.join(both[:3])}{more}{split}"


def _named_files(source: Any) -> set[str]:
    """The resolved paths a files source names (a pattern that matches nothing yet stands for
    itself, so two equal patterns still count as the same files)."""
    if not isinstance(source, FilesSource):
        return set()
    out: set[str] = set()
    for pattern in source.files:
        matched = glob.glob(os.path.expanduser(pattern), recursive=True)
        out.update(str(Path(p).resolve()) for p in matched or [pattern])
    return out


class PlanStep(BaseModel):
    """One stage computation in the resolved plan; ``parent`` is the step whose output it reads."""

    index: int
    stage: Stage
    parent: int | None
    variants: list[str] = Field(default_factory=list)


def format_validation_error(err: ValidationError, where: str, as_options: bool = False) -> str:
    """The one message for a pydantic error: a heading naming ``where``, then one line per
    problem naming the field path (``variants.1.stages.0.quantize.bits``) or, ``as_options``,
    the command-line option (``--group-size``) of a command that builds a recipe section."""
    lines = [f"{where}: {'invalid options' if as_options else 'the recipe is invalid'}"]
    methods = ", ".join(QUANTIZE_STAGES)
    for e in err.errors():
        parts, method = _readable_loc(e["loc"])
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


def _readable_loc(loc: tuple[int | str, ...]) -> tuple[list[str], str | None]:
    """The field path as a recipe spells it, and the quantize method it is under (if any):
    pydantic puts the union's tag (``quantize.gptq.clip``) and validator names in the path."""
    parts: list[str] = []
    method = None
    for i, p in enumerate(loc):
        if p == "function-after[_exactly_one(), Stage]":
            continue
        if i and loc[i - 1] == "quantize" and p in QUANTIZE_STAGES:
            method = str(p)
            continue
        parts.append(str(p))
    return parts, method


def _owners(key: str) -> str:
    """Which methods have ``key``, for the error that refuses it under another method."""
    owners = [m for m, cls in QUANTIZE_STAGES.items() if key in cls.model_fields]
    if not owners:
        return " (check the spelling)"
    return f" (it belongs to method{'s' if len(owners) > 1 else ''} {' and '.join(owners)})"


def parse_recipe(data: Any, where: str = "recipe") -> Recipe:
    """Validate a parsed YAML/JSON document into a Recipe, or raise RecipeError naming fields."""
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a mapping of keys to values, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, where)) from None


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    return parse_recipe(data, where=str(path))


def recipe_json_schema() -> dict[str, Any]:
    """JSON schema of a recipe (for editors and the Prefect UI's parameter form)."""
    return Recipe.model_json_schema(by_alias=True)
