"""Per-shape tile choice: the fastest candidate on a GPU, the default on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from thresher.serve_kernels.kernels import moe, nf4, tuning, w4a16
from thresher.serve_kernels.kernels.backend import TileConfig

A = TileConfig(16, 64, 64, 4)
B = TileConfig(16, 128, 64, 4)
C = TileConfig(16, 128, 64, 8)


def test_fastest_skips_failures_and_takes_the_minimum():
    times = {A: 3.0, B: 1.0, C: 2.0}

    def run(cfg):
        if cfg == B:
            raise RuntimeError("out of resources: shared memory")
        return cfg

    assert tuning.fastest([A, B, C], run, lambda fn: times[fn()]) == C
    assert tuning.fastest([B], run, lambda fn: times[fn()]) is None


def test_cpu_calls_take_the_default():
    t = tuning.Tuner("test")
    assert t.pick(("k",), torch.zeros(1), A, [B, C], lambda cfg: pytest.fail("timed")) == A
    assert not t.chosen


def test_a_gpu_times_each_shape_once(monkeypatch):
    runs: list[TileConfig] = []
    speed = {A: 3.0, B: 1.0, C: 2.0}
    monkeypatch.setattr(tuning, "cuda_seconds", lambda fn: speed[fn()])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    on_gpu = SimpleNamespace(is_cuda=True)
    t = tuning.Tuner("test")

    def run(cfg):
        runs.append(cfg)
        return cfg

    assert t.pick(("shape", 1), on_gpu, A, [B, C], run) == B
    assert sorted(runs, key=str) == sorted([A, B, C], key=str)
    assert t.pick(("shape", 1), on_gpu, A, [B, C], run) == B and len(runs) == 3  # cached
    monkeypatch.setenv(tuning.ENV_VAR, "0")
    assert t.pick(("shape", 2), on_gpu, A, [B, C], run) == A and len(runs) == 3
    monkeypatch.delenv(tuning.ENV_VAR)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert t.pick(("shape", 3), on_gpu, A, [B, C], run) == A and len(runs) == 3  # in a capture
    assert ("shape", 3) not in t.chosen


def test_an_engine_step_times_nothing_and_takes_the_nearest_rows(monkeypatch):
    """Inside ``serving`` (an engine step) a new shape is never timed: it takes the tile chosen
    for the nearest row count of the same matrix with the default's rows per tile, else the
    default; outside it the same shape is timed as before."""
    monkeypatch.setattr(tuning, "cuda_seconds", lambda fn: {A: 3.0, B: 1.0, C: 2.0}[fn()])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    on_gpu = SimpleNamespace(is_cuda=True)
    t = tuning.Tuner("test")
    prefill = TileConfig(64, 64, 64, 4)

    def untimed(cfg):
        pytest.fail("timed inside an engine step")

    assert t.pick((1, "w"), on_gpu, A, [B, C], lambda cfg: cfg) == B  # start-up: timed
    assert t.pick((64, "w"), on_gpu, A, [C], lambda cfg: cfg) == C
    with tuning.serving():
        assert t.pick((16, "w"), on_gpu, A, [B, C], untimed) == C  # 64 is nearer than 1
        assert t.pick((2, "w"), on_gpu, A, [B, C], untimed) == B
        assert t.pick((128, "w"), on_gpu, prefill, [B], untimed) == prefill  # other tile rows
        narrow_k = TileConfig(16, 64, 32, 4)
        assert t.pick((4, "w"), on_gpu, narrow_k, [B], untimed) == narrow_k  # other K tile
        assert t.pick((2, "other"), on_gpu, A, [B, C], untimed) == A  # no such matrix timed
    assert (16, "w") not in t.chosen
    assert t.pick((16, "w"), on_gpu, A, [B, C], lambda cfg: cfg) == B  # outside: timed


def test_candidates_vary_around_the_default():
    for module in (w4a16, nf4, moe):  # the MoE kernel's rows are its alignment's block
        for default in module.CONFIGS.values():
            cands = module.tile_candidates(default)
            assert cands[0] == default and len(set(cands)) == len(cands) > 4
            assert all(c.block_m == default.block_m and c.block_k == default.block_k
                       for c in cands)
    assert {c.block_n for c in moe.tile_candidates(moe.DECODE)} == {32, 64, 128}
    assert tuning.m_bucket(7) == 7 and tuning.m_bucket(17) == 32 and tuning.m_bucket(64) == 64
    assert tuning.describe(A) == "16x64x64/s4/w4/st3"


def test_grouped_tiles_are_keyed_by_their_k_tile(monkeypatch):
    """The grouped kernel's K tile must lie in one group: a tile chosen for a group of 128 (K
    tile 128) must not serve a group-32 matrix of the same N and K, so their keys differ."""
    from tests.serve_kernels.kernels.helpers import DEVICE, random_awq

    keys = []

    class Recording:
        def pick(self, key, x, default, candidates, run):
            keys.append(key)
            return default

    monkeypatch.setattr(tuning, "tuner", lambda name: Recording())
    x = torch.randn(1, 256, dtype=torch.float16, device=DEVICE)
    for group in (128, 32):
        (qweight, qzeros, scales), _ = random_awq(256, 64, group)
        w4a16.grouped_matmul_triton(x, qweight, qzeros, scales, group, awq=True)
    assert len(keys) == 2 and keys[0] != keys[1]
