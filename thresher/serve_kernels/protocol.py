"""The OpenAI API's request bodies and error body, as the server accepts and returns them.

Field names follow OpenAI's (``max_tokens``, ``logprobs``, ``echo``, ``stream_options``...), so
stock clients and lm-evaluation-harness's ``local-completions`` backend work unchanged. Types are
strict ("5" is not an integer) and unknown fields are ignored, as OpenAI does. Ranges are OpenAI's
where OpenAI defines one (and appear in the server's /openapi.json); what depends on the model
(``top_k`` and ``logit_bias`` ids against the vocabulary) the server checks next. Extensions that
vLLM also accepts: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens`` and
``ignore_eos`` (the load test uses the latter for fixed lengths).

A field that would change the output but that the server does not implement (constrained JSON
output, tools, ``best_of``) is refused unless it has its neutral value, rather than ignored: the
client would otherwise get an output that silently breaks what it asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from thresher.serve_kernels.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
)

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# field -> (whether a value is neutral, why anything else is refused)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "constrained output (JSON mode, JSON schema) is not supported; omit it "
                        "or give {\"type\": \"text\"}"),
    "tools": (lambda v: not v, "tool calling is not supported"),
    "functions": (lambda v: not v, "function calling is not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calling is not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "best_of": (lambda v: v in (None, 1), "only 1 is supported (n gives several samples)"),
}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="served model name (default: the one loaded)")
    temperature: float = Field(1.0, ge=0.0, le=2.0,
                               description="below 1e-5 (0 included) picks the most likely token")
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="extension: sample from the k most likely tokens "
                       "(at most the vocabulary size); -1 or 0: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="extension: drop tokens less likely "
                         "than min_p times the most likely one")
    n: int = Field(1, ge=1, le=MAX_N)
    stop: list[str] = Field(default_factory=list, description="a string or up to 4 strings")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past end-of-sequence")
    speculative_usage: bool = Field(
        False, description="extension: with speculative decoding, add the proposals the target "
        "kept and rejected to the usage (completion_tokens_details.accepted_prediction_tokens / "
        "rejected_prediction_tokens, OpenAI's names for predicted outputs)")
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=MAX_REPETITION_PENALTY, description="extension: the logit of each token "
        "seen in the prompt or output divided by it if positive, multiplied if not (1: off)")
    min_tokens: int = Field(0, ge=0, description="extension: no end-of-sequence, stop token or "
                            "stop string ends the completion before this many tokens")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None \
        = Field(None, description="token id (as a string) -> bias added to its logit")

    # accepted only at their neutral values (UNSUPPORTED says why)
    response_format: Any = Field(None, description="not supported: only {\"type\": \"text\"}")
    tools: Any = Field(None, description="not supported: only empty")
    functions: Any = Field(None, description="not supported: only empty")
    tool_choice: Any = Field(None, description="not supported: only \"none\"")
    function_call: Any = Field(None, description="not supported: only \"none\"")
    best_of: Any = Field(None, description="not supported: only 1")

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        neutral, why = UNSUPPORTED[info.field_name]
        if not neutral(v):
            raise ValueError(why)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else [] if v is None else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, stops: list[str]) -> list[str]:
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, description="0 with echo scores the prompt only")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: None = Field(None, description="not supported (no fill-in-the-middle)")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token-id prompts must not be empty")
        if isinstance(v, list) and isinstance(v[0], int) and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _zero_tokens_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only meaningful with echo (scoring the prompt)")
        return self


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_param(loc: tuple[Any, ...]) -> str | None:
    """The request field a pydantic error location names (``("body", "max_tokens")``)."""
    parts = [str(p) for p in loc if p != "body"]
    return parts[0] if parts else None
