"""The server with speculative decoding: the same greedy text, vLLM's spec-decode metrics, the
per-request usage of proposals, and `thresher serve --draft` refusing what it cannot serve."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from tests.conftest import build_random_model
from tests.serve_kernels.conftest import save_family
from thresher.cli import app as cli_app
from thresher.serve_kernels import LLM, LLMEngine, SamplingParams
from thresher.serve_kernels.engine.speculative import SpeculativeConfig
from thresher.serve_kernels.server import BackgroundServer, ServerConfig, build_app

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


@pytest.fixture(scope="module")
def server(tiny_demo):
    engine = LLMEngine(tiny_demo, max_num_seqs=4, max_model_len=512,
                       speculative=SpeculativeConfig(str(tiny_demo), 4))
    with BackgroundServer(build_app(engine, ServerConfig(served_model_name="tiny"))) as srv:
        yield srv


def _metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_speculative_server_answers_as_plain_decoding(server, tiny_demo):
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "speculative_usage": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    want = LLM(tiny_demo, max_model_len=512).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == want.text
    details = r.json()["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] >= 0
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "speculative_usage": False},
                       timeout=120).json()
    assert "completion_tokens_details" not in plain["usage"]
    m = _metrics(server.url)
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= m["vllm:spec_decode_num_draft_tokens_total"]
    assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert m["vllm:spec_decode_draft_acceptance_rate"] == pytest.approx(
        accepted / m["vllm:spec_decode_num_draft_tokens_total"])
    assert m["thresher_spec_decode_mean_accepted_length"] > 1
    assert m["thresher_spec_decode_draft_seconds_total"] > 0
    assert m["thresher_spec_decode_verify_seconds_total"] > 0


def test_serve_refuses_bad_speculative_options(tiny_demo, tmp_path):
    runner = CliRunner()
    other = save_family(build_random_model("qwen3_moe", vocab_size=12), tiny_demo, tmp_path / "d")
    mismatch = runner.invoke(cli_app, ["serve", str(tiny_demo), "--draft", str(other)])
    assert mismatch.exit_code != 0 and "Traceback" not in mismatch.output
    assert "has a vocabulary of 12 tokens" in " ".join(mismatch.output.split())
    alone = runner.invoke(cli_app, ["serve", str(tiny_demo), "--num-speculative-tokens", "3"])
    assert alone.exit_code == 2 and "needs --draft" in " ".join(alone.output.split())
    big = runner.invoke(cli_app, ["serve", str(tiny_demo), "--draft", "ngram",
                                  "--num-speculative-tokens", "40"])
    assert big.exit_code == 2
    assert ("Invalid value for '--num-speculative-tokens': Input should be less than or equal "
            "to 16") in " ".join(big.output.split())
