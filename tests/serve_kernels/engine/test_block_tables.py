"""The persistent block tables stay equal to the tables rebuilt from the sequences' block lists
through admissions, prefix-cache hits, growth, preemption, aborts and finishes: the real engine
on the tiny demo model with a KV cache small enough to preempt."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from thresher.serve_kernels import LLMEngine, SamplingParams
from thresher.serve_kernels.engine.block_table import BlockTables
from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.engine.sequence import Sequence

SHARED = "def main():\n    for i in range(10):\n        print(i, i * i)\n"


def rebuilt(seqs) -> torch.Tensor:
    """The zero-padded [len(seqs), width] table built from the Python block lists."""
    width = max(len(s.block_table) for s in seqs)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                        dtype=torch.int32)


def check(engine: LLMEngine, *extra: Sequence) -> None:
    """Every sequence holding blocks (the engine's requests and ``extra``) has its own row equal
    to its list, zero after it; every other row is zero and free."""
    tables = engine.block_manager.tables
    seqs = [*engine._seqs.values(), *extra]
    live = [s for s in seqs if s.table_row is not None]
    assert all(s.block_table for s in live)
    assert not any(s.block_table for s in seqs if s.table_row is None)
    rows = [s.table_row for s in live]
    assert len(set(rows)) == len(rows)
    assert tables.num_free_rows + len(rows) == tables.tables.shape[0]
    expected = torch.zeros_like(tables.tables)
    for s in live:
        expected[s.table_row, : len(s.block_table)] = torch.tensor(s.block_table)
    assert torch.equal(tables.tables, expected)
    if live:  # what a step gathers for a batch is the rebuilt table
        batch = sorted(live, key=lambda s: -s.table_row)
        idx = torch.tensor([s.table_row for s in batch])
        width = max(len(s.block_table) for s in batch)
        assert torch.equal(tables.gather(idx, width), rebuilt(batch))
        rows = sorted(s.table_row for s in live)
        view = tables.batch_tables(rows, torch.tensor(rows), width)
        by_row = sorted(live, key=lambda s: s.table_row)
        assert torch.equal(view[:, :width], rebuilt(by_row))


def test_tables_follow_admission_growth_preemption_abort_and_finish(tiny_demo):
    engine = LLMEngine(tiny_demo, max_num_seqs=6, max_model_len=256, block_size=8,
                       num_kv_blocks=40, max_num_batched_tokens=64)
    for i in range(8):  # a shared prefix: later requests take cached blocks at admission
        engine.add_request(f"r{i}", SHARED + f"x = {i}\n",
                           SamplingParams(temperature=0, max_tokens=40 + 8 * i, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        check(engine)
        if steps == 12:
            running = engine.scheduler.running
            engine.abort_request(running[len(running) // 2].request_id)
            check(engine)
    assert engine.scheduler.num_preempted_total > 0
    assert engine.scheduler.prefix_hit_tokens_total > 0
    tables = engine.block_manager.tables
    assert tables.num_free_rows == tables.tables.shape[0] and not tables.tables.any()


def test_a_probe_longer_than_the_rows_widens_them(tiny_demo):
    """A caller that bypasses admission (the tests' prompt probe) may hold more blocks than
    ``max_model_len`` gives a row; the tables widen and keep every row."""
    engine = LLMEngine(tiny_demo, max_num_seqs=2, max_model_len=32, block_size=8,
                       num_kv_blocks=32)
    engine.add_request("r", "import os\n", SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    probe = Sequence("probe", list(range(1, 81)), SamplingParams(max_tokens=1), 1)
    assert engine.block_manager.allocate(probe, 80)
    check(engine, probe)
    assert engine.block_manager.tables.tables.shape[1] >= 10
    hidden, _ = engine.runner.hidden_states(ScheduledBatch([probe], [80]))
    assert hidden.shape[0] == 80
    engine.block_manager.free(probe)
    check(engine, probe)


def test_host_rows_point_at_the_rows_a_cpu_step_reads():
    """(address, stride) of consecutive rows or one repeated row are the rows ``batch_tables``
    views, read where the C step reads them; after a widening too. Other rows: None (gather)."""
    tables = BlockTables(6, 4, torch.device("cpu"))

    def read(where: tuple[int, int], n: int) -> torch.Tensor:
        address, stride = where
        width = tables.tables.shape[1]
        return torch.stack([torch.from_numpy(np.ctypeslib.as_array(
            (ctypes.c_int32 * width).from_address(address + 4 * i * stride))).clone()
            for i in range(n)])

    for width in (4, 9):
        if width > tables.tables.shape[1]:
            tables._widen(width)
        tables.tables.copy_(torch.arange(6 * width, dtype=torch.int32).view(6, width))
        assert torch.equal(read(tables.host_rows([2, 3, 4]), 3), tables.tables[2:5])
        assert tables.host_rows([3, 3, 3])[1] == 0
        assert torch.equal(read(tables.host_rows([3, 3, 3]), 3), tables.tables[[3, 3, 3]])
        assert tables.host_rows([4, 2]) is None
        assert tables.host_rows([1, 3]) is None
