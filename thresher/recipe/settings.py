"""The recipe's run settings: where variants are published, how the engine validates them, where
MLflow tracks them and where (which work pool, which device) they compute."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from thresher.recipe.base import StrictModel

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
    draft_of_base: bool = Field(
        False, description="score every variant as a speculative-decoding draft of the base: "
        "the base served with the variant proposing, greedy over the agreement prompts "
        "(acceptance rate, mean accepted length, tokens/s and speedup over plain decoding)")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="tokens a draft proposes "
                                        "per verify step when a variant is scored as a draft")


class TrackingConfig(StrictModel):
    """Where the MLflow runs go."""

    mlflow_uri: str | None = Field(None, description="default: $MLFLOW_TRACKING_URI, else SQLite")
    experiment: str | None = Field(None, description="default: the recipe name")



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

