"""What the server guarantees, over HTTP on the real engine and the tiny demo model: hostile
sampling parameters are refused with their field named or answered, one request's failure
reaches its client alone, and the limits (body size, prompt length) hold before any work."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve_kernels.engine.test_isolation import FailingSampler
from tests.serve_kernels.test_server import sse_events, wait_idle
from thresher.serve_kernels import LLMEngine
from thresher.serve_kernels.server import (
    REQUEST_ID_HEADER,
    BackgroundServer,
    ServerConfig,
    bind_warning,
    build_app,
)

BODY_LIMIT = 64 * 1024
PROMPT = "def main(argv):\n    "


@pytest.fixture(scope="module")
def server(tiny_demo):
    engine = LLMEngine(tiny_demo, max_num_seqs=16, max_model_len=256)
    app = build_app(engine, ServerConfig(served_model_name="tiny", max_num_seqs=16, max_queue=16,
                                         max_body_bytes=BODY_LIMIT))
    with BackgroundServer(app) as srv:
        srv.app = app
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def hostile_cases(vocab: int) -> list[tuple[str, object, str | None]]:
    """(field, value, the field a 400 must name, or None when the request is answered)."""
    return [
        ("temperature", 1e-300, None), ("temperature", 1e-45, None),
        ("temperature", 1e30, "temperature"), ("temperature", 2.0, None),
        ("top_p", 0.0, None), ("top_p", 1.0, None), ("min_p", 0.0, None), ("min_p", 1.0, None),
        ("top_k", -1, None), ("top_k", 0, None), ("top_k", vocab, None),
        ("top_k", 2**31, "top_k"), ("top_k", 2**63, "top_k"), ("top_k", -2, "top_k"),
        ("frequency_penalty", 1e30, "frequency_penalty"),
        ("frequency_penalty", -1e30, "frequency_penalty"), ("frequency_penalty", 2.0, None),
        ("presence_penalty", 1e30, "presence_penalty"),
        ("presence_penalty", -1e30, "presence_penalty"), ("presence_penalty", -2.0, None),
        ("logit_bias", {"5": 1e30}, "logit_bias"), ("logit_bias", {"5": -1e30}, "logit_bias"),
        ("logit_bias", {"5": 100.0, "6": -100.0}, None),
        ("logit_bias", {str(vocab): 1.0}, "logit_bias"),
        ("logit_bias", {str(2**70): 1.0}, "logit_bias"), ("logit_bias", {"-1": 1.0}, "logit_bias"),
        ("logit_bias", {"five": 1.0}, "logit_bias"),
        ("seed", -(2**63), None), ("seed", 2**63 - 1, None), ("seed", 0, None),
        ("seed", 2**63, "seed"), ("seed", -(2**63) - 1, "seed"), ("seed", 2**64, "seed"),
        # what the server does not implement is refused, not ignored; neutral values pass
        ("response_format", {"type": "json_object"}, "response_format"),
        ("response_format", {"type": "text"}, None),
        ("tools", [{"type": "function", "function": {"name": "f"}}], "tools"), ("tools", [], None),
        ("tool_choice", "auto", "tool_choice"), ("tool_choice", "none", None),
        ("best_of", 4, "best_of"), ("best_of", 1, None),
        ("repetition_penalty", 1e30, "repetition_penalty"), ("repetition_penalty", 0.0,
                                                                "repetition_penalty"),
        ("repetition_penalty", 10.0, None), ("repetition_penalty", 0.01, None),
        ("min_tokens", 2, None), ("min_tokens", 3, "min_tokens"), ("min_tokens", -1, "min_tokens"),
        ("stop_token_ids", [5], None), ("stop_token_ids", [vocab], "stop_token_ids"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        # vLLM's decoding extensions that are not implemented: refused unless neutral
        ("guided_json", {"type": "object"}, "guided_json"), ("guided_choice", ["a"], "guided_choice"),
        ("structured_outputs", {"regex": "a+"}, "structured_outputs"),
        ("use_beam_search", True, "use_beam_search"), ("use_beam_search", False, None),
        ("skip_special_tokens", False, "skip_special_tokens"), ("skip_special_tokens", True, None),
        ("include_stop_str_in_output", True, "include_stop_str_in_output"),
        ("bad_words", ["x"], "bad_words"), ("allowed_token_ids", [1, 2], "allowed_token_ids"),
        ("prompt_logprobs", 1, "prompt_logprobs"),
        ("user", "someone", None),  # informational fields stay ignored, as OpenAI's server does
    ]


CHAT_CASES = [("echo", True, "echo"), ("echo", False, None), ("chat_template", "{{ x }}",
                                                               "chat_template"),
              ("chat_template_kwargs", {"enable_thinking": True}, "chat_template_kwargs"),
              ("add_generation_prompt", False, None)]


@pytest.mark.parametrize(("endpoint", "n"), [("completions", 1), ("completions", 16),
                                              ("chat/completions", 16)])
def test_hostile_sampling_parameters_are_refused_by_name_or_answered(server, client, endpoint, n):
    prompt = ({"prompt": PROMPT} if endpoint == "completions"
              else {"messages": [{"role": "user", "content": PROMPT}]})
    cases = hostile_cases(server.engine.vocab_size)
    for field, value, refused in cases + (CHAT_CASES if endpoint.startswith("chat") else []):
        body = {**prompt, "max_tokens": 2, "n": n, "temperature": 0.7, field: value}
        r = client.post(f"/v1/{endpoint}", json=body)
        case = f"{field}={value!r} n={n}: {r.status_code} {r.text[:300]}"
        if refused:
            assert r.status_code == 400, case
            assert r.json()["error"]["param"] == refused, case
        else:
            assert r.status_code == 200, case
            choices = r.json()["choices"]
            assert len(choices) == n and all(c["finish_reason"] for c in choices), case
        assert client.get("/health").status_code == 200, case
    wait_idle(server)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_null_leaves_every_optional_field_at_its_default(client, endpoint):
    """OpenAI's spec marks its optional fields nullable and clients send null for the ones they
    leave unset: each is answered as if left out (were 400s for temperature, n, stream...)."""
    from thresher.serve_kernels.protocol import ChatCompletionRequest, CompletionRequest

    model = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    base = ({"prompt": PROMPT} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": PROMPT}]})
    base = {**base, "max_tokens": 2}
    optional = [name for name, f in model.model_fields.items() if not f.is_required()]
    assert {"temperature", "n", "stream", "top_p", "min_tokens"} <= set(optional)
    for name in optional:
        body = {**base, name: None} if name != "max_tokens" else base
        r = client.post(f"/v1/{endpoint}", json=body)
        assert r.status_code == 200, f"{name}=null: {r.text[:300]}"
    everything = {**{name: None for name in optional}, **base}
    assert client.post(f"/v1/{endpoint}", json=everything).status_code == 200


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "x", "temperature": 1e999}',
                                 b'{"prompt": "x", "top_p": -Infinity}'])
def test_non_finite_numbers_are_refused(client, raw):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("temperature", "top_p"), r.text


def test_tiny_temperature_is_greedy(client):
    req = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    greedy = client.post("/v1/completions", json={**req, "temperature": 0}).json()
    tiny = client.post("/v1/completions", json={**req, "temperature": 1e-300}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_one_requests_sampling_failure_reaches_its_client_alone(server, client, monkeypatch):
    reqs = [{"prompt": p, "max_tokens": 12, "temperature": 0.8, "seed": i, "ignore_eos": True}
            for i, p in enumerate([PROMPT, "import os\n", "class A:\n    "])]
    clean = [client.post("/v1/completions", json=r).json()["choices"][0]["text"] for r in reqs]
    victim = {"prompt": "for i in range(", "max_tokens": 12, "temperature": 0.8, "seed": 4242,
              "ignore_eos": True}

    class SeedFailing(FailingSampler):  # the victim's params are built by the server: by seed
        def __call__(self, logits, params, positions, output_ids=None):
            self.victim = next((p for p in params if p.seed == 4242), None)
            return super().__call__(logits, params, positions, output_ids)

    engine = server.engine
    monkeypatch.setattr(engine, "sampler", SeedFailing(engine.sampler, None, after=3))
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.post, "/v1/completions", json=r) for r in [*reqs, victim]]
        answers = [f.result(timeout=120) for f in futures]
    for r, text in zip(answers[:3], clean, strict=True):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    failed = answers[3]
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert failed.headers[REQUEST_ID_HEADER] in error["message"]
    assert "injected" not in failed.text and "RuntimeError" not in failed.text
    # streamed, the failure arrives as an error event after the 200
    with client.stream("POST", "/v1/completions", json={**victim, "stream": True}) as r:
        events = sse_events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "internal_error"
    assert r.headers[REQUEST_ID_HEADER] in events[-2]["error"]["message"]
    assert client.get("/health").status_code == 200
    wait_idle(server)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_failure_adding_one_request_is_a_500_with_a_request_id(server, client, monkeypatch):
    engine = server.engine
    real = engine.add_request

    def add_request(request_id, prompt, params):
        if params.seed == 99:
            raise RuntimeError("secret detail")
        return real(request_id, prompt, params)

    monkeypatch.setattr(engine, "add_request", add_request)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "seed": 98,
                                             "n": 3})
    assert r.status_code == 500 and "secret" not in r.text
    assert r.headers[REQUEST_ID_HEADER] in r.json()["error"]["message"]
    ok = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.headers[REQUEST_ID_HEADER]
    assert client.get("/health").status_code == 200
    wait_idle(server)


def test_a_handler_exception_is_logged_not_echoed(server, client, monkeypatch, caplog):
    tokenizer = server.engine.tokenizer

    def broken(*args, **kwargs):
        raise RuntimeError("secret template detail")

    monkeypatch.setattr(tokenizer, "apply_chat_template", broken)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2})
    assert r.status_code == 500 and "secret" not in r.text
    rid = r.headers[REQUEST_ID_HEADER]
    assert r.json()["error"]["message"].count(rid) == 1
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)


def test_body_size_cap(client):
    big = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no content-length: the cap holds while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert client.get("/health").status_code == 200


def test_prompt_length_is_checked_before_tokenizing(server, client, monkeypatch):
    tokenizer = server.engine.tokenizer
    calls = []
    real = type(tokenizer).encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or real(
        tokenizer, *a, **k))
    limit = server.app.state.async_engine.engine.max_model_len * max(
        map(len, tokenizer.get_vocab()))
    r = client.post("/v1/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a" * (limit + 1)}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/completions", json={"prompt": ["a"] * 33, "n": 1, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # 33 > 16 + 16
    assert calls == []
    r = client.post("/v1/completions", json={"prompt": [1] * 257, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_openapi_describes_the_request_bodies(client):
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"),
                       ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{name}"
        props = components[name]["properties"]
        assert (props["temperature"]["minimum"], props["temperature"]["maximum"]) == (0, 2)
        assert props["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
        assert props["frequency_penalty"]["maximum"] == 2
        assert props["n"]["maximum"] == 16
    assert "ChatMessage" in components  # nested models resolve
    assert "prompt" in components["CompletionRequest"]["required"]


def test_empty_api_key_is_refused_and_non_loopback_binds_warn():
    with pytest.raises(ValueError, match="API key is empty"):
        ServerConfig(served_model_name="x", api_key="")
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert bind_warning(host, None) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost.example"):
        assert "without an API key" in bind_warning(host, None)
        assert bind_warning(host, "key") is None


def test_request_ids_differ(client):
    ids = {client.get("/health").headers[REQUEST_ID_HEADER] for _ in range(3)}
    assert len(ids) == 3
