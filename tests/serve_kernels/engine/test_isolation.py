"""One request's failure inside the engine fails that request alone: the real engine on the tiny
demo model, with an exception injected into one sequence's sampling."""

from __future__ import annotations

import pytest

from thresher.serve_kernels import LLMEngine, SamplingParams
from thresher.serve_kernels.engine.llm_engine import LLM, RequestFailed

PROMPTS = ["def main():", "import os\n", "class A:\n    ", "for i in range(10):"]


@pytest.fixture(scope="module")
def engine(tiny_demo):
    return LLMEngine(tiny_demo, max_num_seqs=8, max_model_len=256)


def params() -> list[SamplingParams]:
    """Seeded sampling: a row drawn again after a failed batch must draw what it drew before."""
    return [SamplingParams(temperature=0.9, seed=10 + i, max_tokens=12, ignore_eos=True)
            for i in range(len(PROMPTS))]


def run(engine: LLMEngine, ps: list[SamplingParams]) -> dict[str, object]:
    for i, (prompt, p) in enumerate(zip(PROMPTS, ps, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return final


class FailingSampler:
    """The engine's own sampler, raising (after drawing) whenever ``victim`` is among the rows
    from its ``after``-th step on."""

    def __init__(self, sampler, victim: SamplingParams, after: int):
        self.sampler, self.victim, self.after, self.seen = sampler, victim, after, 0

    def __call__(self, logits, params, positions, output_ids=None):
        result = self.sampler(logits, params, positions, output_ids)
        if any(p is self.victim for p in params):
            self.seen += 1
            if self.seen > self.after:
                raise RuntimeError("injected sampling failure")
        return result


def test_a_sampling_failure_fails_one_request_and_the_others_are_unchanged(engine, monkeypatch):
    clean = run(engine, params())
    ps = params()
    failing = FailingSampler(engine.sampler, ps[3], after=4)
    monkeypatch.setattr(engine, "sampler", failing)
    out = run(engine, ps)
    assert failing.seen > failing.after  # the victim decoded beside the others, then failed
    for i in range(3):
        assert out[f"r{i}"].finish_reason == "length"
        assert out[f"r{i}"].token_ids == clean[f"r{i}"].token_ids
    victim = out["r3"]
    assert victim.finish_reason == "error" and "injected sampling failure" in victim.error
    assert len(victim.token_ids) == failing.after  # what it had before the failure
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.running
    assert not engine.has_unfinished_requests()


def test_a_failing_update_fails_one_request(engine, monkeypatch):
    """The per-sequence update (detokenizing, stop conditions) is isolated the same way."""
    real = engine._append_token

    def append(seq, sampled, row):
        if seq.request_id == "r1":
            raise ValueError("injected update failure")
        return real(seq, sampled, row)

    monkeypatch.setattr(engine, "_append_token", append)
    out = run(engine, [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
                       for _ in PROMPTS])
    assert out["r1"].finish_reason == "error" and "injected update failure" in out["r1"].error
    assert all(out[f"r{i}"].finish_reason == "length" for i in (0, 2, 3))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_offline_generation_raises_on_a_failed_request(tiny_demo, monkeypatch):
    llm = LLM(tiny_demo, max_model_len=128)
    p = SamplingParams(temperature=0.5, seed=1, max_tokens=3)
    monkeypatch.setattr(llm.engine, "sampler", FailingSampler(llm.engine.sampler, p, after=0))
    with pytest.raises(RequestFailed, match="injected sampling failure"):
        llm.generate(["def f():", "import os"], p)
