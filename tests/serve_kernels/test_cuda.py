"""The engine on a CUDA GPU: decode CUDA graphs against eager steps, no host synchronisation in
a decode forward, the KV cache sized from GPU memory, greedy parity with the CPU path. Skipped
without a GPU; ``benchmarks/scale/gpu_suite.py`` runs them on a lent one."""

from __future__ import annotations

import gc

import pytest
import torch

from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.engine.sequence import Sequence

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 300, 42, 9, 77, 1023], [12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640, 4, 5],
           [7, 7, 7, 100, 200]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def graphed(tiny_demo):
    return LLM(tiny_demo, dtype="bfloat16", max_model_len=512, max_num_seqs=8, num_kv_blocks=256)


def test_graphs_are_captured_and_match_eager(graphed, tiny_demo):
    assert graphed.engine.model_info["cuda_graphs"]
    assert sorted(graphed.engine.runner.decode_graphs.graphs) == [1, 2, 4, 8]
    eager = LLM(tiny_demo, dtype="bfloat16", max_model_len=512, max_num_seqs=8,
                num_kv_blocks=256, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    want = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in graphed.generate(PROMPTS, GREEDY)] == want
    assert [o.token_ids for o in graphed.generate(PROMPTS[:1], GREEDY)] == want[:1]  # bucket 1


def test_decode_forward_never_synchronises(graphed):
    """A decode forward (every layer: attention, MoE alignment, kernels) under CUDA's sync
    debug mode "error": any device-to-host read raises."""
    runner = graphed.engine.runner
    graphs, runner.decode_graphs = runner.decode_graphs, None  # the eager path
    seqs = []
    try:
        for i, ids in enumerate(PROMPTS):
            seq = Sequence(f"s{i}", ids, SamplingParams(max_tokens=4), 4)
            assert graphed.engine.block_manager.allocate(seq, len(ids) + 1)
            seqs.append(seq)
        runner.hidden_states(ScheduledBatch(seqs, [len(s.token_ids) for s in seqs]))
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
            seq.token_ids.append(3)
        batch = ScheduledBatch(seqs, [1] * len(seqs))
        runner.hidden_states(batch)  # compile outside the check
        torch.cuda.synchronize()
        original = runner.model.forward

        def checked(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.model.forward = checked
        try:
            runner.hidden_states(batch)
        finally:
            runner.model.forward = original
    finally:
        for seq in seqs:
            graphed.engine.block_manager.free(seq)
        runner.decode_graphs = graphs


def test_kv_cache_sized_from_gpu_memory(tiny_demo):
    """The share is this engine's, whatever other engines (this module's ``graphed``, other
    test workers) hold; free memory caps it."""
    free, total = torch.cuda.mem_get_info()
    sizes = []
    for utilization in (0.05, 0.3):
        llm = LLM(tiny_demo, dtype="bfloat16", gpu_memory_utilization=utilization,
                  enforce_eager=True)
        sizes.append(llm.engine.model_info["kv_cache_bytes"])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert 0 < sizes[0] <= 0.05 * total and 0 < sizes[1] <= 0.3 * total
    if free > 0.35 * total:
        assert sizes[0] < sizes[1]
    fixed = LLM(tiny_demo, dtype="bfloat16", kv_cache_gb=0.25, enforce_eager=True)
    assert 0.24 * 2**30 < fixed.engine.model_info["kv_cache_bytes"] <= 0.25 * 2**30


def test_greedy_matches_transformers_on_cuda(graphed, tiny_demo):
    """bf16 on both sides: the engine's kernels against transformers' eager modules."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_demo, dtype=torch.bfloat16).cuda().eval()
    got = [o.token_ids for o in graphed.generate(PROMPTS, GREEDY)]
    agree = total = 0
    for ids, g in zip(PROMPTS, got, strict=True):
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24,
                               min_new_tokens=24, do_sample=False, pad_token_id=0)
        agree += sum(a == b for a, b in zip(g, want[0, len(ids):].tolist(), strict=True))
        total += len(g)
    assert agree >= 0.9 * total


def test_weights_larger_than_the_free_gpu_memory_are_refused(monkeypatch, tiny_demo):
    """A clear error before loading, not a CUDA out-of-memory part-way through."""
    from thresher.errors import ModelError

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 << 30))
    with pytest.raises(ModelError, match=r"serving \S+/tiny-\w+ in bfloat16 needs at least 3 MiB of "
                                         r"memory; 1 MiB is available here \(free on "):
        LLM(tiny_demo, dtype="bfloat16")
