"""The engine's GPU code path, run on the CPU: the Triton kernels through Triton's interpreter
(``THRESHER_KERNELS=triton``, ``TRITON_INTERPRET=1``) must give the CPU path's greedy tokens,
with mixed decode + prefill steps and split-KV decode exercised; KV-cache sizing rules."""

from __future__ import annotations

import pytest
import torch

from thresher.compress.api import quantize_model
from thresher.formats.nf4 import NF4Weight
from thresher.quant.nf4 import NF4_CODES
from thresher.recipe import NF4Stage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.kv_budget import (
    KV_BUDGET_BYTES,
    GPUMemory,
    KVCacheConfig,
    kv_cache_budget,
    size_kv_cache,
)
from thresher.serve_kernels.engine.model_runner import graph_buckets
from thresher.serve_kernels.kernels import attention, fused_moe, tuning
from thresher.serve_kernels.modeling.linear import DenseLinear, NF4Linear
from thresher.serve_kernels.modeling.moe import ExpertLoop, stack_nf4

PROMPTS = [[5, 17, 300, 42, 9, 77, 1023], [12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640, 4, 5]]


@pytest.mark.slow
def test_triton_path_matches_cpu_greedy(tiny_demo, monkeypatch):
    """10 tokens per step: the 13-token prompt is chunked, so a step mixes a decode row with a
    prefill chunk; 8-token partitions make decode attention split its KV."""
    llm = LLM(tiny_demo, block_size=4, dtype="float32", num_kv_blocks=32, max_model_len=64,
              max_num_batched_tokens=10, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    monkeypatch.setattr(attention, "PARTITION", 8)
    calls = []
    split = attention.paged_decode_attention_triton

    def counting(*args, **kwargs):
        calls.append(attention.decode_splits(args[0].shape[0], args[1].shape[2], args[6]))
        return split(*args, **kwargs)

    monkeypatch.setattr("thresher.serve_kernels.kernels.attention.paged_decode_attention_triton",
                        counting)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert max(calls) >= 2  # some decode step ran split-KV


@pytest.mark.slow
def test_nf4_triton_path_matches_cpu_greedy(tiny_demo, tmp_path, monkeypatch):
    """The tiny demo's NF4 artifact: its experts stacked for the fused kernel on the GPU path
    give the CPU path's greedy tokens."""
    out = tmp_path / "nf4"
    quantize_model(tiny_demo, NF4Stage(double_quant=True), None, out, show_progress=False)
    llm = LLM(out, dtype="float32", num_kv_blocks=32, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    loops = [m for m in llm.engine.runner.model.modules() if isinstance(m, ExpertLoop)]
    assert loops and all(loop.gpu_fused for loop in loops)


def test_engine_steps_run_inside_serving(tiny_demo, monkeypatch):
    """A step's forwards run inside ``tuning.serving`` (no tile timed mid-request); start-up's
    forwards, before any step, do not."""
    llm = LLM(tiny_demo, max_model_len=64, dtype="float32")
    depths = []
    run = llm.engine.runner.run
    monkeypatch.setattr(llm.engine.runner, "run",
                        lambda batch: depths.append(tuning._SERVING) or run(batch))
    llm.generate([[5, 17, 300]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert depths and all(d == 1 for d in depths) and tuning._SERVING == 0


def test_eager_decode_warm_up_stores_nothing(tiny_demo):
    """An engine without CUDA graphs warms its decode shapes up at start (so the kernels time
    their tiles then, not in a request): one forward per batch bucket over padding slots, which
    leaves the KV cache as it was."""
    llm = LLM(tiny_demo, max_model_len=64, dtype="float32", max_num_seqs=5)
    runner = llm.engine.runner
    before = [c.clone() for layer in runner.kv_caches for c in layer]
    forwards = []
    hook = runner.model.register_forward_pre_hook(lambda m, args: forwards.append(len(args[0])))
    runner.warm_up_decode(5, 64)
    hook.remove()
    assert forwards == list(reversed(graph_buckets(5)))
    after = [c for layer in runner.kv_caches for c in layer]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_kv_cache_sizing_rules():
    per_block, per_seq = 1 << 20, 8
    cpu_default = size_kv_cache(KVCacheConfig(), per_block, per_seq, 4, None)
    assert cpu_default == min(4 * per_seq, KV_BUDGET_BYTES // per_block)  # today's CPU rule
    assert size_kv_cache(KVCacheConfig(num_blocks=50), per_block, per_seq, 4, None) == 50
    assert size_kv_cache(KVCacheConfig(cache_gb=0.5), per_block, per_seq, 4, None) == 512
    gpu = size_kv_cache(KVCacheConfig(), per_block, per_seq, 4, lambda: 300 * per_block)
    assert gpu == 300
    with pytest.raises(ValueError, match="give one of them"):
        KVCacheConfig(num_blocks=3, cache_gb=1.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        KVCacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_gb=0"):
        KVCacheConfig(cache_gb=0)


def test_gpu_share_is_per_engine_and_capped_by_free_memory():
    """vLLM's meaning of gpu_memory_utilization: another process's 60 GiB does not shrink this
    engine's share, what the engine loaded (2 GiB of tensors, 0.5 GiB outside torch's pool) and
    its activation peak do, and the cache never takes more than is free."""
    gib = 2**30
    start = GPUMemory(total=80 * gib, free=20 * gib, allocated=0, reserved=0)
    now = GPUMemory(total=80 * gib, free=int(17.5 * gib), allocated=2 * gib, reserved=2 * gib)
    assert kv_cache_budget(start, now, gib, 0.1) == 8 * gib - int(2.5 * gib) - gib
    assert kv_cache_budget(start, now, gib, 0.9) == int(16.5 * gib)  # free memory, not the share
    assert kv_cache_budget(start, now, gib, 0.01) < 0  # the engine reports it cannot fit
    alone = GPUMemory(total=80 * gib, free=80 * gib, allocated=0, reserved=0)
    after = GPUMemory(total=80 * gib, free=77 * gib, allocated=2 * gib, reserved=3 * gib)
    assert kv_cache_budget(alone, after, 0, 0.5) == 40 * gib - 2 * gib  # pool slack is free


def test_graph_buckets_cover_every_batch_size():
    assert graph_buckets(1) == [1]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_expert_loop_gpu_path_matches_routed_loop():
    """Every expert weighted by its (mostly zero) routing weight equals visiting routed experts."""
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter = 4, 32, 16

    def linear(n, k):
        return DenseLinear(torch.randn(n, k, generator=gen) / k**0.5)

    loop = ExpertLoop([linear(inter, hidden) for _ in range(experts)],
                      [linear(inter, hidden) for _ in range(experts)],
                      [linear(hidden, inter) for _ in range(experts)])
    x = torch.randn(5, hidden, generator=gen)
    weights, ids = torch.randn(5, experts, generator=gen).softmax(-1).topk(2, dim=-1)
    torch.testing.assert_close(loop._every_expert(x, weights, ids), loop(x, weights, ids))


def _nf4_linear(n: int, k: int, gen: torch.Generator) -> NF4Linear:
    packed = torch.randint(0, 256, (n * k // 2, 1), generator=gen, dtype=torch.uint8)
    absmax = (torch.rand(n * k // 64, generator=gen) + 0.5) / k**0.5
    return NF4Linear(NF4Weight(packed, absmax, torch.tensor(NF4_CODES), (n, k)), None)


def test_nf4_experts_run_the_fused_kernel_on_the_gpu_path(monkeypatch):
    """NF4 experts on the GPU path are stacked once for the fused kernel (routed experts only,
    where they were every expert), their linears left reading views of the stacked bytes (one
    copy in memory); the result is the routed loop's."""
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter = 4, 128, 64
    loop = ExpertLoop([_nf4_linear(inter, hidden, gen) for _ in range(experts)],
                      [_nf4_linear(inter, hidden, gen) for _ in range(experts)],
                      [_nf4_linear(hidden, inter, gen) for _ in range(experts)])
    dense = [torch.cat([g.dequantized(), u.dequantized()])
             for g, u in zip(loop.gate, loop.up, strict=True)]
    x = torch.randn(5, hidden, generator=gen)
    weights, ids = torch.randn(5, experts, generator=gen).softmax(-1).topk(2, dim=-1)
    expected = loop(x, weights, ids)  # the CPU path: the routed experts' reference linears
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    launched = []
    monkeypatch.setattr("thresher.serve_kernels.modeling.moe.fused_moe",
                        lambda *a: launched.append(a[1].format) or fused_moe(*a))
    torch.testing.assert_close(loop(x, weights, ids), expected, rtol=1e-4, atol=1e-4)
    assert launched == ["nf4"]
    gate_up, down = loop.gpu_fused
    assert gate_up.out_in == (2 * inter, hidden) and down.out_in == (hidden, inter)
    assert torch.equal(gate_up.dequantize(), torch.stack(dense))
    storage = gate_up.weight.untyped_storage().data_ptr()
    assert all(m.nf4.packed.untyped_storage().data_ptr() == storage for m in (*loop.gate, *loop.up))
    assert torch.equal(loop.gate[1].dequantized(), dense[1][:inter])  # the views read the same


def test_nf4_experts_the_kernel_cannot_read_keep_every_expert(monkeypatch):
    """Blocks straddling rows (K not a multiple of 64): no stacking, every expert weighted."""
    gen = torch.Generator().manual_seed(1)
    loop = ExpertLoop([_nf4_linear(32, 96, gen) for _ in range(2)],
                      [_nf4_linear(32, 96, gen) for _ in range(2)],
                      [_nf4_linear(96, 32, gen) for _ in range(2)])
    assert stack_nf4(list(loop.gate), list(loop.up), list(loop.down)) is None
    x = torch.randn(3, 96, generator=gen)
    weights, ids = torch.randn(3, 2, generator=gen).softmax(-1).topk(1, dim=-1)
    expected = loop(x, weights, ids)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    torch.testing.assert_close(loop(x, weights, ids), expected, rtol=1e-4, atol=1e-4)
    assert loop.gpu_fused is False


class EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: ``replay`` runs the same forward over the
    same static buffers, so the runner's bucketing, padding and buffer copies are what is tested."""

    def __init__(self, model, args, out):
        self.model, self.args, self.out = model, args, out

    def replay(self) -> None:
        self.out.copy_(self.model(*self.args))


def test_decode_replay_bookkeeping_matches_eager(tiny_demo):
    """Static buffers, bucket choice (3 sequences pad to 4, then 1), padding rows and block tables
    of the graph path give the eager path's greedy tokens."""
    llm = LLM(tiny_demo, block_size=4, dtype="float32", num_kv_blocks=64, max_model_len=64,
              max_num_seqs=4, enable_prefix_caching=False)
    prompts = [*PROMPTS, [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    g = runner.static_buffers(4, 64)
    for bs in graph_buckets(4):
        g.graphs[bs] = EagerReplay(runner.model, runner.graph_args(g, bs, 64), g.hidden[:bs])
    runner.decode_graphs = g
    replays = []
    for bs, graph in g.graphs.items():
        graph.replay = (lambda f, b: lambda: (replays.append(b), f())[1])(graph.replay, bs)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert [o.token_ids for o in llm.generate(prompts[:1], params)] == expected[:1]
    assert set(replays) == {4, 1}


def test_a_kernel_that_cannot_compile_leaves_decode_eager(tiny_demo, caplog, monkeypatch):
    """Triton's own errors (out of shared memory, a compile error) during the capture's warm-up
    leave the runner eager and serving, as a capture error does, instead of aborting start-up."""
    from triton.runtime.errors import OutOfResources

    llm = LLM(tiny_demo, block_size=4, dtype="float32", num_kv_blocks=64, max_model_len=64,
              max_num_seqs=4, enable_prefix_caching=False)
    runner = llm.engine.runner

    def fails(*args):
        raise OutOfResources(232448, 101376, "shared memory")

    with monkeypatch.context() as patch, caplog.at_level("WARNING"):
        patch.setattr(runner.model, "forward", fails)
        runner.capture_decode_graphs(4, 64)
    assert runner.decode_graphs is None and "decode stays eager" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:1], params)[0].token_ids) == 3
