"""OpenAI-compatible HTTP API over the serving engine.

``/v1/completions`` and ``/v1/chat/completions`` (streamed with server-sent events or not),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/openapi.json`` (every request body
with its ranges). Handlers check the request (body size, fields, prompt length before tokenizing),
tokenize, check it against the context length, submit to the ``AsyncEngine`` (whose thread alone
touches the engine) and shape its outputs as OpenAI responses. Every failure is an OpenAI error
body with the right status; a 5xx body carries the request id (also the ``x-request-id`` header
of every response) and never the exception, which goes to the log under that id. A client that
goes away aborts its sequences, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from thresher.serve_kernels import SamplingParams
from thresher.serve_kernels.async_engine import (
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestFailed,
    RequestGroup,
)
from thresher.serve_kernels.engine.sampling_params import InvalidSamplingParam
from thresher.serve_kernels.metrics import CONTENT_TYPE, ServerMetrics
from thresher.serve_kernels.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    error_param,
)

log = logging.getLogger(__name__)

# Used when the tokenizer has no chat template of its own (the demo tokenizer has none): each
# message as "<|role|>\n" + content + "\n", then "<|assistant|>\n" to prompt the reply. Replies stop
# at FALLBACK_CHAT_STOP, where the model starts the next turn's tag.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FALLBACK_CHAT_STOP = "\n<|"
DISCONNECT_POLL_S = 0.25
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
MAX_BODY_BYTES = 8 * 2**20  # a full 128k-token prompt as JSON token ids is about 1 MiB
ENGINE_FAILED_EXIT = 3  # `thresher serve`'s exit status after an engine failure
REQUEST_ID_HEADER = "x-request-id"


@dataclass
class ServerConfig:
    """What the server needs besides the engine.

    ``api_key``: None serves without a key; an empty string is refused (it is what an unset
    variable expands to, and a server that meant to require a key must not start open).
    """

    served_model_name: str
    api_key: str | None = None
    max_num_seqs: int = 64
    max_queue: int = 256
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: pass a non-empty key, or none at all to serve "
                             "without one")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: must be >= 1")


def bind_warning(host: str, api_key: str | None) -> str | None:
    """What to warn about when ``host`` is reachable from other machines and no key is set."""
    if api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to anything
        pass
    return (f"serving on {host} without an API key: anyone who can reach this port can use the "
            "model; set --api-key (or THRESHER_API_KEY), or bind 127.0.0.1")


class APIError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status)


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


class RequestIds:
    """Gives every request an id: in ``request.state.request_id``, and in the response's
    ``x-request-id`` header, so a client can quote it and the log can be searched for it.

    An exception no handler answered is logged under that id and answered here with a 500 that
    names only the id (Starlette's own last-resort handler would re-raise it and close the
    connection).
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [h for h in message.get("headers", [])
                           if h[0].lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(),
                                                             rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as err:
            log.error("request %s failed", rid, exc_info=err)
            if started:  # too late for a status: the connection is closed
                raise
            await JSONResponse(internal_error(rid), status_code=500)(scope, receive,
                                                                     send_with_id)


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "-")


def internal_error(rid: str) -> dict[str, Any]:
    """A 5xx body: what happened in general, and the id under which the log has the details."""
    return error_body(f"internal error (request id {rid}); the server log has the details",
                      "server_error", code="internal_error")


class RequestCounter:
    """Counts requests by endpoint and status (plain ASGI: Starlette's BaseHTTPMiddleware would
    hide client disconnects from the handlers)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": "disconnected"}

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(path, status["code"]).inc()


# --- the app --------------------------------------------------------------------------------------


def build_app(engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``LLMEngine``); the engine loop runs while it lives."""
    metrics = ServerMetrics()
    aengine = AsyncEngine(engine, config.max_num_seqs, config.max_queue, metrics)
    metrics.watch_engine(lambda: (aengine.snapshot.stats, aengine.snapshot.tokens_per_second,
                                  aengine.in_flight))
    api = _API(engine, aengine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        try:
            yield
        finally:
            aengine.shutdown()

    app = FastAPI(title="thresher", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = aengine
    app.state.metrics = metrics
    app.openapi = lambda: _openapi(app)

    app.add_middleware(RequestIds)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: counts RequestIds' 500s

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(err.detail), kind), status_code=err.status_code)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, err: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the sequences were aborted

    @app.exception_handler(EngineDead)
    async def _engine_dead(_: Request, err: EngineDead) -> JSONResponse:
        return JSONResponse(ENGINE_DEAD, status_code=503)

    @app.exception_handler(RequestFailed)
    async def _request_failed(request: Request, err: RequestFailed) -> JSONResponse:
        rid = request_id(request)
        log.error("request %s failed in the engine: %s", rid, err)
        return JSONResponse(internal_error(rid), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if aengine.error is not None:
            return JSONResponse(ENGINE_DEAD, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        api.authorize(request)
        return JSONResponse({"object": "list", "data": [api.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> JSONResponse:
        api.authorize(request)
        api.check_model(model)
        return JSONResponse(api.model_card())

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        api.authorize(request)
        body = _parse(CompletionRequest, await _json_body(request, config.max_body_bytes))
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        api.authorize(request)
        body = _parse(ChatCompletionRequest, await _json_body(request, config.max_body_bytes))
        return await api.chat(body, request)

    return app


ENGINE_DEAD = error_body("the engine failed; this server must be restarted", "server_error",
                         code="engine_unavailable")


def _request_body(model: type[SamplingFields]) -> dict[str, Any]:
    """The OpenAPI requestBody of an endpoint that parses ``model`` itself (to answer OpenAI's
    error bodies rather than FastAPI's)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the protocol's request models (with their ranges) as components."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest):
            full = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(full.pop("$defs", {}))
            components[model.__name__] = full
        app.openapi_schema = schema
    return app.openapi_schema


async def _json_body(request: Request, limit: int) -> Any:
    """The body as JSON; refused (413) past ``limit`` bytes, keeping none of the excess.

    The excess is read and dropped up to another ``limit`` bytes, so that the client reads the
    413 (a server that closes with unread bytes resets the connection, and the answer is lost);
    beyond that reading stops and the connection may be reset.
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > 2 * limit:
            break
    declared = request.headers.get("content-length", "")
    if size > limit or (declared.isdigit() and int(declared) > limit):
        raise APIError(413, f"the request body exceeds {limit} bytes (the server's "
                       "--max-body-bytes)", code="body_too_large")
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") \
            from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply", code="invalid_json") from None


def _parse(model: type[SamplingFields], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = error_param(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        where = f"'{param}': " if param else ""
        raise APIError(400, f"{where}{message}", param=param, code="invalid_value") from None


# --- request handling -----------------------------------------------------------------------------


@dataclass
class _Choice:
    """What one sequence has produced so far, and how much of it was already streamed."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    draft_tokens: int = 0  # speculative proposals verified for this sequence
    accepted_tokens: int = 0  # of which the target kept
    echoed_chars: int = 0  # length of the echoed prompt text ahead of the completion's
    sent_text: int = 0
    sent_tokens: int = 0

    def update(self, out) -> None:
        self.token_ids = list(out.token_ids)
        self.text = out.text
        self.finish_reason = out.finish_reason
        self.draft_tokens, self.accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        if out.logprobs is not None:
            self.logprobs = list(out.logprobs)
        if out.top_logprobs is not None:
            self.top_logprobs = list(out.top_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if out.prompt_top_logprobs is not None:
            self.prompt_top_logprobs = list(out.prompt_top_logprobs)


class _API:
    """The endpoints' logic, sharing the engine, the tokenizer and the config."""

    def __init__(self, engine, aengine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.aengine = aengine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        # No token spans more characters than the longest vocabulary entry, so a text longer than
        # this cannot fit the context whatever its tokenization: refused before tokenizing it.
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = engine.max_model_len * max(longest, 1)

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    def model_card(self) -> dict[str, Any]:
        info = {k: v for k, v in dict(self.engine.model_info).items()
                if isinstance(v, str | int | float | bool)}
        return {"id": self.config.served_model_name, "object": "model", "created": self.created,
                "owned_by": "thresher", "max_model_len": self.engine.max_model_len, **info}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{self.config.served_model_name}' (see /v1/models)",
                           param="model", code="model_not_found")

    # --- prompts ---

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def encode(self, text: str) -> list[int]:
        """Text to token ids as the engine encodes a text prompt (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_length(self, chars: int, param: str) -> None:
        """Refuse a text or token list that cannot fit the context, before tokenizing anything."""
        if chars > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.engine.max_model_len}"
                           f" tokens; the {param} has {chars} characters, more than any "
                           f"tokenization of it could fit. Shorten the {param}.", param=param,
                           code="context_length_exceeded")

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt[0], int):
            prompt = [prompt]
        for p in prompt:
            self.check_length(len(p) if isinstance(p, str) else 0, "prompt")
            if not isinstance(p, str) and len(p) > self.engine.max_model_len:
                raise APIError(400, f"This model's maximum context length is "
                               f"{self.engine.max_model_len} tokens; the prompt has {len(p)}. "
                               "Shorten the prompt.", param="prompt",
                               code="context_length_exceeded")
        prompts = []
        for p in prompt:
            ids = self.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "'prompt': the prompt is empty", param="prompt")
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise APIError(400, f"'prompt': token id {bad[0]} is outside the vocabulary "
                               f"(size {self.vocab_size})", param="prompt")
            prompts.append(ids)
        return prompts

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], list[str]]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self.check_length(sum(len(m["content"]) for m in messages), "messages")
        template = None if self.tokenizer.chat_template else FALLBACK_CHAT_TEMPLATE
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, chat_template=template)
        except TemplateError as err:  # the template refused these messages (role order, ...)
            raise APIError(400, f"'messages': the model's chat template rejected them: {err}",
                           param="messages", code="invalid_chat_template") from None
        ids = self.encode(text)
        return ids, ([FALLBACK_CHAT_STOP] if template else [])

    def completion_budget(self, prompt_len: int, requested: int | None) -> int:
        """Tokens to generate: ``requested``, or what the context leaves; refuse an overflow."""
        limit = self.engine.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens; the "
                               f"prompt has {prompt_len}. Shorten the prompt.", param="prompt",
                               code="context_length_exceeded")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the "
                           f"request asks for {prompt_len + requested} ({prompt_len} in the "
                           f"prompt, {requested} for the completion). Shorten the prompt or "
                           "lower max_tokens.", param="max_tokens", code="context_length_exceeded")
        return requested

    def sampling(self, body: SamplingFields, max_tokens: int, choice: int, logprobs: int | None,
                 prompt_logprobs: bool, extra_stop: list[str]) -> SamplingParams:
        """The engine's parameters for one choice; a value the engine refuses is a 400 naming its
        field (choice j of n samples with seed + j, still a 64-bit seed for the generator)."""
        try:
            params = SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                min_p=body.min_p, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                logit_bias={int(t): b for t, b in (body.logit_bias or {}).items()},
                max_tokens=max_tokens, stop=[*body.stop, *extra_stop],
                stop_token_ids=list(body.stop_token_ids),
                seed=None if body.seed is None else body.seed + choice,
                ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            )
            params.check_vocab(self.vocab_size)
        except InvalidSamplingParam as err:
            raise APIError(400, f"'{err.field}': {err.reason}", param=err.field,
                           code="invalid_value") from None
        return params

    def check_capacity(self, sequences: int) -> None:
        if sequences > self.aengine.capacity:
            raise APIError(400, f"the request needs {sequences} sequences (prompts x n); this "
                           f"server admits at most {self.aengine.capacity} at a time", param="n")

    async def submit(self, prompts: list[list[int]], params: list) -> RequestGroup:
        self.check_capacity(len(prompts))
        try:
            return await self.aengine.submit(prompts, params)
        except QueueFull as err:
            raise APIError(429, f"the server is at capacity ({err}); retry later",
                           "rate_limit_error", code="queue_full") from None
        except InvalidSamplingParam as err:
            raise APIError(400, f"'{err.field}': {err.reason}", param=err.field,
                           code="invalid_value") from None
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from None

    # --- /v1/completions ---

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompt = body.prompt
        count = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
        self.check_capacity(count * body.n)  # before tokenizing what would be refused anyway
        # tokenizing a long prompt takes milliseconds: off the event loop, which serves streams
        prompts = await asyncio.to_thread(self.completion_prompts, body.prompt)
        scoring_only = body.max_tokens == 0
        seqs, params = [], []
        for ids in prompts:
            # Scoring (max_tokens 0 with echo) runs one hidden generation step: the engine scores
            # prompts while it prefills them.
            budget = self.completion_budget(len(ids), 1 if scoring_only else body.max_tokens)
            for j in range(body.n):
                seqs.append(ids)
                params.append(self.sampling(body, budget, j, body.logprobs,
                                            body.echo and body.logprobs is not None, []))
        group = await self.submit(seqs, params)
        choices = [_Choice(ids, []) for ids in seqs]
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.config.served_model_name}
        if body.stream:
            return _sse(self._stream_completion(group, choices, body, head, scoring_only),
                        request_id(request))
        await _collect(group, choices, request)
        out = []
        for i, c in enumerate(choices):
            if scoring_only:
                c.token_ids, c.text, c.logprobs, c.top_logprobs = [], "", [], []
            prompt_text = self.tokenizer.decode(c.prompt_ids) if body.echo else ""
            lp = None
            if body.logprobs is not None:
                ids, lps, tops = c.token_ids, c.logprobs or [], c.top_logprobs or []
                if body.echo:
                    ids, lps, tops = c.prompt_ids + ids, self.prompt_scores(c) + lps, \
                        self.prompt_tops(c) + tops
                lp = self.completion_logprobs(ids, lps, tops,
                                              0 if body.echo else len(prompt_text))
            text = c.text
            out.append({"index": i, "text": prompt_text + text, "logprobs": lp,
                        "finish_reason": c.finish_reason})
        return JSONResponse({**head, "choices": out,
                             "usage": _usage(choices, body, scoring_only)})

    def prompt_scores(self, c: _Choice) -> list[float | None]:
        if c.prompt_logprobs is None or len(c.prompt_logprobs) != len(c.prompt_ids):
            raise RuntimeError(f"the engine returned no prompt log-probabilities for "
                               f"{len(c.prompt_ids)} prompt tokens")
        return c.prompt_logprobs

    @staticmethod
    def prompt_tops(c: _Choice) -> list[dict[int, float] | None]:
        """The alternatives at each prompt position (none with logprobs=0: the token alone)."""
        return c.prompt_top_logprobs or [None] * len(c.prompt_ids)

    def top_entries(self, token_id: int, logprob: float | None,
                    top: dict[int, float] | None) -> dict[str, float] | None:
        """The alternatives at one position, by token text, always including the chosen token
        (prompt positions too: lm-eval tells from them whether a continuation is greedy)."""
        if logprob is None:
            return None
        entries = {self.token_text(t): lp for t, lp in (top or {}).items()}
        entries.setdefault(self.token_text(token_id), logprob)
        return entries

    def completion_logprobs(self, ids: list[int], lps: list[float | None],
                            tops: list[dict[int, float] | None], start: int) -> dict[str, Any]:
        """OpenAI's completion logprobs object; ``start`` is the first token's text offset."""
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], start
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = list(tops) + [None] * (len(ids) - len(tops))
        top = [self.top_entries(t, lp, tp) for t, lp, tp in zip(ids, lps, tops, strict=True)]
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top,
                "text_offset": offsets}

    async def _stream_completion(self, group: RequestGroup, choices: list[_Choice],
                                 body: CompletionRequest, head: dict,
                                 scoring_only: bool) -> AsyncIterator[str]:
        echoed: set[int] = set()
        with _aborting(group):
            async for i, out in group:
                c = choices[i]
                c.update(out)
                if scoring_only:
                    c.token_ids, c.text, c.logprobs, c.top_logprobs = [], "", [], []
                prompt_text = ""
                if body.echo and i not in echoed:  # the prompt (and its scores) come first
                    echoed.add(i)
                    prompt_text = self.tokenizer.decode(c.prompt_ids)
                    c.echoed_chars = len(prompt_text)
                text_start = c.echoed_chars + c.sent_text  # text_offset counts the choice's text
                delta, new_ids, new_lps, new_tops = _advance(c)
                lp = None
                if body.logprobs is not None and (new_ids or prompt_text):
                    ids, lps, tops, start = new_ids, new_lps, new_tops, text_start
                    if prompt_text:
                        ids, lps, start = c.prompt_ids + new_ids, self.prompt_scores(c) + new_lps, 0
                        tops = self.prompt_tops(c) + new_tops
                    lp = self.completion_logprobs(ids, lps, tops, start)
                delta = prompt_text + delta
                if delta or lp or out.finished:
                    yield _event({**head, "choices": [{
                        "index": i, "text": delta, "logprobs": lp,
                        "finish_reason": c.finish_reason if out.finished else None}]})
            if body.stream_options and body.stream_options.include_usage:
                yield _event({**head, "choices": [],
                              "usage": _usage(choices, body, scoring_only)})
            yield "data: [DONE]\n\n"

    # --- /v1/chat/completions ---

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        ids, extra_stop = await asyncio.to_thread(self.chat_prompt, body)
        budget = self.completion_budget(len(ids), body.token_limit)
        n_lp = (body.top_logprobs or 0) if body.logprobs else None
        params = [self.sampling(body, budget, j, n_lp, False, extra_stop) for j in range(body.n)]
        group = await self.submit([ids] * body.n, params)
        choices = [_Choice(ids, []) for _ in range(body.n)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.config.served_model_name}
        if body.stream:
            return _sse(self._stream_chat(group, choices, body, head), request_id(request))
        await _collect(group, choices, request)
        out = []
        for i, c in enumerate(choices):
            lp = {"content": self.chat_logprobs(c.token_ids, c.logprobs or [],
                                                c.top_logprobs or [])} if body.logprobs else None
            out.append({"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse({**head, "object": "chat.completion", "choices": out,
                             "usage": _usage(choices, body, False)})

    def chat_logprobs(self, ids: list[int], lps: list[float],
                      tops: list[dict[int, float]]) -> list[dict[str, Any]]:
        """OpenAI's chat logprobs ``content`` list: each token with its ``top_logprobs`` most
        likely alternatives, exactly that many (a sampled token outside them is not added: it
        has its own ``logprob``)."""

        def entry(text: str, lp: float) -> dict[str, Any]:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        tops = list(tops) + [None] * (len(ids) - len(tops))
        content = []
        for t, lp, top in zip(ids, lps, tops, strict=False):
            ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
            content.append({**entry(self.token_text(t), lp),
                            "top_logprobs": [entry(self.token_text(k), v) for k, v in ranked]})
        return content

    async def _stream_chat(self, group: RequestGroup, choices: list[_Choice],
                           body: ChatCompletionRequest, head: dict) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        with _aborting(group):
            for i in range(len(choices)):
                yield _event({**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                         "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
            async for i, out in group:
                c = choices[i]
                c.update(out)
                delta, new_ids, new_lps, new_tops = _advance(c)
                lp = {"content": self.chat_logprobs(new_ids, new_lps, new_tops)} \
                    if body.logprobs and new_ids else None
                if delta or lp or out.finished:
                    yield _event({**head, "choices": [{
                        "index": i, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                        "finish_reason": c.finish_reason if out.finished else None}]})
            if body.stream_options and body.stream_options.include_usage:
                yield _event({**head, "choices": [], "usage": _usage(choices, body, False)})
            yield "data: [DONE]\n\n"


def _advance(c: _Choice) -> tuple[str, list[int], list[float], list[dict[int, float]]]:
    """The text, token ids, log-probs and top alternatives since the last chunk (now sent)."""
    delta = c.text[c.sent_text:] if len(c.text) > c.sent_text else ""
    c.sent_text = max(c.sent_text, len(c.text))
    new = slice(c.sent_tokens, len(c.token_ids))
    new_ids = c.token_ids[new]
    new_lps = (c.logprobs or [])[new]
    new_tops = (c.top_logprobs or [])[new]
    c.sent_tokens = len(c.token_ids)
    return delta, new_ids, new_lps, new_tops


def _usage(choices: list[_Choice], body, scoring_only: bool) -> dict:
    n = body.n
    prompt = sum(len(c.prompt_ids) for c in choices[::n])
    completion = 0 if scoring_only else sum(len(c.token_ids) for c in choices)
    usage: dict = {"prompt_tokens": prompt, "completion_tokens": completion,
                   "total_tokens": prompt + completion}
    if body.speculative_usage:
        accepted = sum(c.accepted_tokens for c in choices)
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(c.draft_tokens for c in choices) - accepted}
    return usage


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _sse(events: AsyncIterator[str], rid: str) -> StreamingResponse:
    return StreamingResponse(_guarded(events, rid), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _guarded(events: AsyncIterator[str], rid: str) -> AsyncIterator[str]:
    """A failure after the stream started (status 200 already sent) ends it with an error event."""
    try:
        async for event in events:
            yield event
    except EngineDead:
        yield _event(ENGINE_DEAD)
        yield "data: [DONE]\n\n"
    except Exception as err:
        log.error("request %s failed mid-stream", rid, exc_info=err)
        yield _event(internal_error(rid))
        yield "data: [DONE]\n\n"


@contextlib.contextmanager
def _aborting(group: RequestGroup) -> Iterator[None]:
    """Abort the group's unfinished sequences if the body ends early (client gone, error)."""
    try:
        yield
    finally:
        if not group.finished:
            group.abort()


async def _collect(group: RequestGroup, choices: list[_Choice], request: Request) -> None:
    """Run a non-streamed request to the end, aborting it if the client disconnects."""

    async def consume() -> None:
        async for i, out in group:
            choices[i].update(out)

    task = asyncio.create_task(consume())
    with _aborting(group):
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return
            if await request.is_disconnected():
                task.cancel()
                raise ClientGone("client disconnected")


# --- running the server ---------------------------------------------------------------------------


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: an address in use or not this
    machine's fails at once (OSError), not after the load with an exit status that asks a
    supervisor to restart."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run_server(app: FastAPI, host: str, port: int, sock: socket.socket | None = None) -> int:
    """Serve ``app`` until stopped (on ``sock`` when given, from ``bind_listener``); the exit
    status: 0, or ``ENGINE_FAILED_EXIT`` when the engine failed (every waiter has its error by
    then), so that a supervisor restarts the process."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    aengine: AsyncEngine = app.state.async_engine

    def stop() -> None:
        log.critical("the engine failed; stopping the server so that it can be restarted")
        server.should_exit = True

    aengine.on_failure = stop
    server.run(sockets=None if sock is None else [sock])
    return ENGINE_FAILED_EXIT if aengine.error is not None else 0


class BackgroundServer:
    """uvicorn serving an app on a thread (tests and the validation load test)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.host = host
        self.port = port

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
