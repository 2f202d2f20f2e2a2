"""A step's outputs hand out snapshots of the growing token and log-prob lists: later steps do
not change an output already returned, and it reads like the list it stands for."""

from __future__ import annotations

import json

from thresher.serve_kernels import LLMEngine, SamplingParams
from thresher.serve_kernels.engine.llm_engine import LLM


def test_an_output_is_not_changed_by_later_steps(tiny_demo):
    engine = LLMEngine(tiny_demo, max_num_seqs=2, max_model_len=128)
    engine.add_request("r", "import os\n", SamplingParams(temperature=0, max_tokens=6, logprobs=1,
                                                          ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o, list(o.token_ids), list(o.logprobs)) for o in engine.step()]
    assert len(seen) == 6
    for n, (out, tokens, logprobs) in enumerate(seen, start=1):
        assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs) == n
        assert out.token_ids == tokens and out.logprobs == logprobs
        assert out.token_ids[-1] == out.new_token_ids[0]
        assert out.prompt_token_ids + out.token_ids == out.prompt_token_ids + tokens


def test_offline_outputs_hold_plain_lists(tiny_demo):
    out = LLM(tiny_demo, max_model_len=128).generate(
        "import os\n", SamplingParams(temperature=0, max_tokens=4, logprobs=0))[0]
    assert type(out.token_ids) is list and type(out.logprobs) is list
    json.dumps([out.token_ids, out.logprobs])
