"""The server through OpenAI's own Python client: what "OpenAI-compatible" means to a user who
points the SDK at it (the bodies parse into the SDK's types, errors map to its exceptions)."""

from __future__ import annotations

import openai
import pytest

from thresher.serve_kernels import LLMEngine, SamplingParams
from thresher.serve_kernels.server import BackgroundServer, ServerConfig, build_app

KEY = "sdk-key"


@pytest.fixture(scope="module")
def client(tiny_demo):
    engine = LLMEngine(tiny_demo, max_num_seqs=8, max_model_len=512)
    app = build_app(engine, ServerConfig(served_model_name="tiny", api_key=KEY, max_num_seqs=8,
                                         max_queue=8))
    with BackgroundServer(app) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_and_completions_with_scores(client, tiny_tokenizer):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    out = client.completions.create(model="tiny", prompt="def main(", max_tokens=6,
                                    temperature=0, logprobs=2, echo=True, seed=1)
    choice = out.choices[0]
    assert choice.text.startswith("def main(") and choice.finish_reason in ("length", "stop")
    n_prompt = len(tiny_tokenizer("def main(").input_ids)
    assert out.usage.prompt_tokens == n_prompt and out.usage.completion_tokens <= 6
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == n_prompt + out.usage.completion_tokens
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])


def test_chat_samples_streams_and_extensions(client):
    messages = [{"role": "user", "content": "a loop"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2,
                                         temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    assert len(out.choices) == 2 and all(c.message.role == "assistant" for c in out.choices)
    assert all(len(t.top_logprobs) == 2 for t in out.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                           temperature=0)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # vLLM's extensions go in extra_body, as with vLLM's server
    ext = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5,
                                         temperature=0, extra_body={"top_k": 1, "min_tokens": 5,
                                                                    "ignore_eos": True})
    assert ext.usage.completion_tokens == 5


def test_errors_are_the_sdks_exceptions(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", temperature=3)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    wrong_key = client.with_options(api_key="not-it")
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


def test_greedy_completion_equals_the_engine(client, tiny_demo):
    from thresher.serve_kernels import LLM

    want = LLM(tiny_demo, max_model_len=512).generate(
        "import os\n", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    got = client.completions.create(model="tiny", prompt="import os\n", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text
