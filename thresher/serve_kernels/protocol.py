"""The OpenAI API's request bodies and error body, as the server accepts and returns them.

Field names follow OpenAI's (``max_tokens``, ``logprobs``, ``echo``, ``stream_options``...), so
stock clients and lm-evaluation-harness's ``local-completions`` backend work unchanged. Types are
strict ("5" is not an integer), null leaves a field at its default and unknown fields are
ignored, as OpenAI does. Ranges are OpenAI's where OpenAI defines one (and appear in the
server's /openapi.json); what depends on the model (``top_k``, ``logit_bias`` and
``stop_token_ids`` against the vocabulary) the server checks next. Extensions that vLLM also
accepts: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos`` (the load test uses it for fixed lengths) and, in chat, ``add_generation_prompt``
and ``continue_final_message``.

A field that would change the output but that the server does not implement (constrained
output, tools, ``best_of``, beam search, vLLM's other decoding extensions) is refused unless it
has its neutral value, rather than ignored: the client would otherwise get an output that
silently breaks what it asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
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


def _unset(v: Any) -> bool:
    return not v


GUIDED = "constrained output (guided decoding, structured outputs) is not supported"
# field -> (whether a value is neutral, why anything else is refused): OpenAI's fields and vLLM's
# extensions that change the output but are not implemented
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "constrained output (JSON mode, JSON schema) is not supported; omit it "
                        "or give {\"type\": \"text\"}"),
    "tools": (_unset, "tool calling is not supported"),
    "functions": (_unset, "function calling is not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calling is not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "best_of": (lambda v: v in (None, 1), "only 1 is supported (n gives several samples)"),
    "guided_json": (_unset, GUIDED), "guided_regex": (_unset, GUIDED),
    "guided_choice": (_unset, GUIDED), "guided_grammar": (_unset, GUIDED),
    "structured_outputs": (_unset, GUIDED),
    "use_beam_search": (_unset, "beam search is not supported"),
    "length_penalty": (lambda v: v in (None, 1), "beam search is not supported"),
    "bad_words": (_unset, "bad_words is not supported (logit_bias can forbid single tokens)"),
    "allowed_token_ids": (_unset, "allowed_token_ids is not supported (logit_bias can forbid "
                          "tokens)"),
    "logits_processors": (_unset, "custom logits processors are not supported"),
    "prompt_logprobs": (lambda v: v is None, "not supported; /v1/completions scores the prompt "
                        "with echo: true and logprobs"),
    "truncate_prompt_tokens": (lambda v: v is None, "prompts are not truncated; shorten it"),
    "skip_special_tokens": (lambda v: v in (None, True), "special tokens are always skipped"),
    "include_stop_str_in_output": (_unset, "stop strings are always cut from the output"),
    "return_tokens_as_token_ids": (_unset, "logprobs name tokens by their text"),
}
# chat completions only (/v1/completions implements echo)
CHAT_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (_unset, "echo is not supported in chat completions (/v1/completions has it)"),
    "chat_template": (lambda v: v is None, "the model's own chat template is always used"),
    "chat_template_kwargs": (_unset, "the model's own chat template is always used"),
    "documents": (_unset, "documents are not supported"),
}


def _takes_null(annotation: Any) -> bool:
    return annotation is Any or type(None) in get_args(annotation)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """null for an optional field that takes no null leaves it at its default, as OpenAI's
        API reads it (its spec marks them nullable, and clients that build requests from
        optional values send null for every one left unset); where null has a meaning of its
        own (``max_tokens``: up to the context) it keeps it."""
        if isinstance(data, dict):
            drop = {k for k, f in cls.model_fields.items() if not f.is_required()
                    and not _takes_null(f.annotation)}
            return {k: v for k, v in data.items() if v is not None or k not in drop}
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False


def _refusing(name: str, base: type[BaseModel],
              table: dict[str, tuple[Callable[[Any], bool], str]]) -> type[BaseModel]:
    """``base`` with ``table``'s fields declared (so /openapi.json lists them) and refused, with
    the reason, unless neutral."""

    def refuse(cls, v: Any, info: ValidationInfo) -> Any:
        neutral, why = table[info.field_name]
        if not neutral(v):
            raise ValueError(why)
        return v

    fields: dict[str, Any] = {field: (Any, Field(None, description=f"not supported: {why}"))
                              for field, (_, why) in table.items()}
    # one validator name per table: a subclass's validator of the same name would replace its
    # base's
    validators = {f"refuse_{name}": field_validator(*table)(refuse)}
    return create_model(name, __base__=base, __validators__=validators, **fields)


class SamplingFields(_refusing("Unsupported", OpenAIModel, UNSUPPORTED)):
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
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="extension: token ids that end the completion, their "
        "text left out as end-of-sequence's is")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None \
        = Field(None, description="token id (as a string) -> bias added to its logit")

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


class ChatCompletionRequest(_refusing("ChatUnsupported", SamplingFields, CHAT_UNSUPPORTED)):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = Field(True, description="extension: end the prompt with the "
                                        "template's opening of an assistant turn")
    continue_final_message: bool = Field(
        False, description="extension: the reply continues the last (assistant) message instead "
        "of starting a new one; needs add_generation_prompt false")
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _options_agree(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a last message from the assistant")
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
