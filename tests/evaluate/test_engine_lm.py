"""Generative tasks through the serving engine, against the reference wrapper, on demo:tiny."""

from __future__ import annotations

import json

import pytest
from lm_eval.api.instance import Instance

from tests.evaluate.test_tasks import noise_damaged
from thresher.evaluate.builtin_tasks import prepare_builtin_tasks
from thresher.evaluate.engine_lm import EngineLM
from thresher.evaluate.lm_wrapper import ThresherLM
from thresher.evaluate.significance import paired_difference, paired_documents
from thresher.evaluate.tasks import run_tasks
from thresher.models import load_model, save_model

pytestmark = pytest.mark.slow
GEN_LIMIT = 60


def _requests(per_task: int, max_gen_toks: int) -> list[Instance]:
    """The first prompts of each generative task with its own stop strings, shorter outputs."""
    root = prepare_builtin_tasks()
    requests = []
    for name, until in (("stdlib_complete_line", ["<|endoftext|>"]),
                        ("stdlib_function_body", ["\n\n\n"])):
        for line in (root / f"{name}.jsonl").read_text().splitlines()[:per_task]:
            kwargs = {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}
            requests.append(Instance("generate_until", {}, (json.loads(line)["context"], kwargs),
                                     len(requests)))
    return requests


def test_engine_generates_what_the_reference_wrapper_does(tiny_demo, tiny_tokenizer):
    """Same greedy text, prompt by prompt, in float32: the engine (KV cache, batched) and the
    wrapper that re-runs the whole sequence per token."""
    requests = _requests(per_task=6, max_gen_toks=16)
    engine = EngineLM(tiny_demo, show_progress=False).generate_until(requests)
    reference = ThresherLM(load_model(tiny_demo), tiny_tokenizer,
                           show_progress=False).generate_until(requests)
    assert engine == reference
    assert sum(bool(t.strip()) for t in engine) >= len(requests) // 2  # mostly real text


def test_engine_lm_without_a_model_refuses_to_score(tiny_demo):
    lm = EngineLM(tiny_demo, show_progress=False)
    with pytest.raises(ValueError, match="without a logits model"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("import ", "os"), 0)])


def test_generative_task_sees_noise_damage_beyond_its_paired_interval(tiny_demo, tiny_tokenizer,
                                                                       tmp_path):
    noisy = save_model(noise_damaged(tiny_demo), tiny_tokenizer, tmp_path / "noisy")
    task = "stdlib_complete_line"
    base = run_tasks(tiny_demo, tasks=[task], limit=GEN_LIMIT, show_progress=False)
    damaged = run_tasks(noisy, tasks=[task], limit=GEN_LIMIT, show_progress=False)
    assert base.backend == damaged.backend == "thresher-engine"
    key = f"{task}/char_similarity"
    assert set(base.per_sample) == {f"{task}/exact_match", key}
    assert len(base.per_sample[key]) == GEN_LIMIT
    assert sum(base.per_sample[key].values()) / GEN_LIMIT == pytest.approx(
        base.scores["stdlib_complete_line"]["char_similarity"].value)
    diff = paired_difference(*paired_documents(base.per_sample[key], damaged.per_sample[key]))
    assert diff.beyond_noise and diff.delta < 0, diff
