"""The stage types of a variant: prune, merge and the quantize methods, each with its own knobs.

A stage is data (what a recipe says); ``prune/``, ``compress/`` and the flows read it. Each
quantize method is its own class, chosen by ``method``, so a knob of another method is an unknown
key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)

from thresher.recipe.base import StrictModel


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
        "counts differ: thresher quantizes, evaluates and serves such a checkpoint; transformers, "
        "vLLM and llama.cpp cannot load it)")
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
    compute_dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "bfloat16", description="dtype bitsandbytes dequantizes to and computes in")

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


STAGE_KINDS = ("prune", "merge", "quantize")


def _kind_of_method(method: Any) -> str | None:
    """The stage kind whose ``method`` field accepts ``method``, if one does."""
    for kind, cls in (("prune", PruneStage), ("merge", MergeStage)):
        if method in cls.model_fields["method"].annotation.__args__:
            return kind
    return "quantize" if method in QUANTIZE_STAGES else None


class Stage(StrictModel):
    """One step of a variant: exactly one of ``prune``, ``merge`` or ``quantize``."""

    model_config = ConfigDict(json_schema_extra=_quantize_choices)

    prune: PruneStage | None = None
    merge: MergeStage | None = None
    quantize: AnyQuantizeStage | None = None

    @model_validator(mode="before")
    @classmethod
    def _named_kind(cls, data: Any) -> Any:
        """A stage written flat (``- method: gptq``) is refused with the nesting it lacks, where
        pydantic alone would call each of its keys unknown."""
        if not isinstance(data, Mapping) or set(data) & set(STAGE_KINDS):
            return data
        kind = _kind_of_method(data.get("method"))
        if kind is None:
            return data
        keys = ", ".join(f"{k}: {v}" for k, v in data.items())
        raise ValueError(f"a stage is written under its kind (prune, merge or quantize): "
                         f"'{kind}: {{{keys}}}'")

    @model_validator(mode="after")
    def _exactly_one(self) -> Stage:
        if sum(s is not None for s in (self.prune, self.merge, self.quantize)) != 1:
            raise ValueError("a stage holds exactly one of 'prune', 'merge' or 'quantize'")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in STAGE_KINDS if getattr(self, k) is not None)

    @property
    def options(self) -> PruneStage | MergeStage | QuantizeStage:
        return getattr(self, self.kind)

    def describe(self) -> str:
        return self.options.describe()


class VariantValidate(StrictModel):
    """A variant's own validation settings, beside the recipe's ``validate`` section."""

    draft: str | None = Field(None, description="another variant of the recipe served as this "
                              "variant's speculative-decoding draft during validation (its "
                              "acceptance rate and the speculative tokens/s are logged here)")


class Variant(StrictModel):
    """One model to derive from the base: its name and its chain of stages (none: the base)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    stages: list[Stage] = Field(default_factory=list)
    validate_: VariantValidate | None = Field(None, alias="validate")

    @model_serializer(mode="wrap")
    def _validate_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A variant without its own validation settings dumps as before (name and stages)."""
        data = handler(self)
        if self.validate_ is None:
            data.pop("validate", None)
            data.pop("validate_", None)
        return data

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

