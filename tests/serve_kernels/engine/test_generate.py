"""End-to-end generation on the trained tiny demo model against transformers."""

from __future__ import annotations

import pytest
import torch

from thresher.evaluate.perplexity import perplexity
from thresher.models import load_model
from thresher.serve_kernels import LLM, LLMEngine, SamplingParams

PROMPTS = ["def main():\n    ", "import os\nimport sys\n", "class Foo(object):",
           "    return self.", "for i in range(10):\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def hf_model(tiny_demo):
    return load_model(tiny_demo)


@pytest.fixture(scope="module")
def reference(tiny_demo, tiny_tokenizer, hf_model):
    """transformers' greedy continuation (up to 64 tokens, stopping at EOS) of each prompt."""
    out = {}
    for p in PROMPTS:
        ids = torch.tensor([tiny_tokenizer.encode(p, add_special_tokens=False)])
        gen = hf_model.generate(ids, max_new_tokens=64, do_sample=False)
        out[p] = gen[0, ids.shape[1]:].tolist()
    return out


def test_greedy_matches_transformers_token_for_token(tiny_demo, reference, tiny_tokenizer):
    llm = LLM(tiny_demo, dtype="float32")
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == reference[p], p
        assert o.finished and o.finish_reason in ("length", "stop")
        assert o.text == tiny_tokenizer.decode(o.token_ids, skip_special_tokens=True)
    stats = llm.engine.stats()
    assert stats.generated_tokens_total == sum(len(o.token_ids) for o in outs)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_preemption_under_a_tiny_kv_budget_keeps_outputs(tiny_demo, reference):
    # 6 blocks of 16 slots: a 64-token continuation needs ~5, so sequences must be preempted
    llm = LLM(tiny_demo, num_kv_blocks=6, max_model_len=96, max_num_seqs=8, dtype="float32")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS]
    stats = llm.engine.stats()
    assert stats.num_preempted_total > 0
    assert stats.kv_blocks_used == 0


def test_prompt_logprobs_survive_preemption_mid_prompt(tiny_demo, tiny_tokenizer):
    """A sequence preempted during its chunked prefill recomputes from position 0; the prompt
    log-probs it already holds must not be appended again (80 tokens once came back as 96)."""
    from thresher.data.windows import eval_windows
    from thresher.recipe import PerplexityConfig

    windows = eval_windows(tiny_tokenizer, PerplexityConfig(seq_len=80, max_windows=4)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=True, ignore_eos=True,
                            logprobs=3)
    want = LLM(tiny_demo, max_model_len=96, dtype="float32").generate(windows, params)
    llm = LLM(tiny_demo, max_model_len=96, max_num_seqs=4, num_kv_blocks=6,
              max_num_batched_tokens=48, dtype="float32")
    got = llm.generate(windows, params)
    assert llm.engine.stats().num_preempted_total > 0
    for g, w in zip(got, want, strict=True):
        assert len(g.prompt_logprobs) == 80 and g.prompt_logprobs[0] is None
        assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
        assert len(g.prompt_top_logprobs) == 80 and g.prompt_top_logprobs[0] is None
        assert [list(t) for t in g.prompt_top_logprobs[1:]] == [
            list(t) for t in w.prompt_top_logprobs[1:]]
        assert g.token_ids == w.token_ids


def test_prompt_top_logprobs_rank_the_alternatives(tiny_demo, tiny_tokenizer):
    """With logprobs=N, each prompt position holds its N most likely tokens, most likely first:
    the first is what greedy decoding of the prompt up to there picks, and the prompt token's
    own log-prob is among them exactly when it ranks in the top N."""
    ids = tiny_tokenizer("for key, value in sorted(items):\n    print(key, value)\n").input_ids
    llm = LLM(tiny_demo, max_model_len=96, dtype="float32")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True,
                                             logprobs=4))[0]
    tops = out.prompt_top_logprobs
    assert tops[0] is None and len(tops) == len(ids)
    for p in range(1, len(ids)):
        ranked = list(tops[p].values())
        assert len(ranked) == 4 and ranked == sorted(ranked, reverse=True)
        assert (ids[p] in tops[p]) == (out.prompt_logprobs[p] >= ranked[-1])
        if ids[p] in tops[p]:
            assert tops[p][ids[p]] == pytest.approx(out.prompt_logprobs[p], abs=1e-5)
    for p in (1, 5, len(ids) - 1):
        greedy = llm.generate([ids[:p]], SamplingParams(temperature=0, max_tokens=1))[0]
        assert greedy.token_ids[0] == next(iter(tops[p]))


def test_chunked_prefill_and_requests_joining_midway(tiny_demo, reference):
    engine = LLMEngine(tiny_demo, max_num_batched_tokens=4, max_num_seqs=3, dtype="float32")
    finished = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 7 == 0:  # one new request every 7 steps
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for out in engine.step():
            assert out.new_token_ids == (out.token_ids[-1:] if out.new_token_ids else [])
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    assert {k: v.token_ids for k, v in finished.items()} == {
        f"r{i}": reference[p] for i, p in enumerate(PROMPTS)}
    assert engine.stats().kv_blocks_used == 0


def test_prefix_cache_reuses_blocks_of_a_repeated_prompt(tiny_demo, tiny_tokenizer):
    llm = LLM(tiny_demo, block_size=8, dtype="float32")
    prompt = "import os\nimport sys\nimport json\nimport math\n" * 3
    n = len(tiny_tokenizer.encode(prompt, add_special_tokens=False))
    first = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_prompt_tokens == 0
    cached_free = llm.engine.stats().kv_blocks_cached_free
    assert cached_free >= n // 8  # the finished request's full blocks stay cached
    second = llm.generate(prompt, GREEDY)[0]
    assert second.num_cached_prompt_tokens == (n - 1) // 8 * 8 > 0
    assert second.token_ids == first.token_ids
    stats = llm.engine.stats()
    assert stats.prefix_cache_hit_tokens == second.num_cached_prompt_tokens
    assert stats.kv_blocks_used == 0  # every block free again (cached ones included)
    # without prefix caching nothing is reused
    plain = LLM(tiny_demo, block_size=8, enable_prefix_caching=False, dtype="float32")
    plain.generate(prompt, GREEDY)
    again = plain.generate(prompt, GREEDY)[0]
    assert again.num_cached_prompt_tokens == 0 and again.token_ids == first.token_ids


def test_concurrent_requests_share_a_cached_system_prompt(tiny_demo, tiny_tokenizer):
    llm = LLM(tiny_demo, block_size=8, dtype="float32")
    system = "class Handler(object):\n    def __init__(self, path):\n        self.path = path\n"
    llm.generate(system + "x", SamplingParams(temperature=0, max_tokens=1))
    outs = llm.generate([system + q for q in ("    def run", "    def stop", "    def get")],
                        SamplingParams(temperature=0, max_tokens=8))
    n = len(tiny_tokenizer.encode(system, add_special_tokens=False))
    assert all(o.num_cached_prompt_tokens >= (n // 8 - 1) * 8 for o in outs)
    assert llm.engine.stats().kv_blocks_used == 0


def test_perplexity_from_prompt_logprobs_matches_the_evaluator(tiny_demo, tiny_tokenizer, hf_model):
    from thresher.data.windows import eval_windows
    from thresher.recipe import PerplexityConfig

    windows = eval_windows(tiny_tokenizer, PerplexityConfig(seq_len=128, max_windows=6))
    expected = perplexity(hf_model, windows, show_progress=False).perplexity
    llm = LLM(tiny_demo, max_model_len=128, max_num_batched_tokens=300, dtype="float32")
    scores = llm.score(windows.tolist())
    assert all(s[0] is None and len(s) == windows.shape[1] for s in scores)
    nll = -sum(sum(s[1:]) for s in scores) / (windows.shape[0] * (windows.shape[1] - 1))
    assert abs(float(torch.tensor(nll).exp()) / expected - 1) < 0.01


def test_abort_frees_blocks_and_reports(tiny_demo):
    engine = LLMEngine(tiny_demo, dtype="float32")
    engine.add_request("a", "def main():", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "import os", SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    engine.abort_request("a")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_blocks_used == 0


def test_add_request_refuses_bad_input(tiny_demo):
    engine = LLMEngine(tiny_demo, max_model_len=32, dtype="float32")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("l", list(range(20)), SamplingParams(max_tokens=20))
    engine.add_request("ok", list(range(1, 20)), SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLMEngine(tiny_demo, max_model_len=64, num_kv_blocks=2, dtype="float32")
    assert engine.model_info["format"] == "bf16" and engine.model_info["num_experts"] == 8
    assert engine.model_info["kv_cache_bytes"] > 0 and engine.model_info["params"] > 0


def test_greedy_matches_transformers_on_small(small_demo):
    """The demo default (hidden 256, 8 heads): up to 64 greedy tokens per prompt."""
    from thresher.models import load_tokenizer

    tok = load_tokenizer(small_demo)
    hf = load_model(small_demo)
    llm = LLM(small_demo, dtype="float32")
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        want = hf.generate(ids, max_new_tokens=64, do_sample=False)
        assert o.token_ids == want[0, ids.shape[1]:].tolist(), p
    assert llm.engine.stats().kv_blocks_used == 0
