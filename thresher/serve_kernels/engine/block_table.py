"""Every live sequence's block table as a row of one persistent tensor, written as blocks change.

Rebuilding a step's [batch, blocks] table from Python lists costs O(batch x context) host time
(9 ms at 64 sequences x 2,048 blocks on a 2-core CPU). Instead a sequence owns a row of
``tables`` from its first block to its release, and the block manager writes the row as it hands
out blocks: a whole cached prefix at admission, then one entry per new block; a release zeroes
the row and frees it. A step gathers its sequences' rows where the tensor lives (the device).

On a CPU the tensor is in host memory and written through a NumPy view of it (no tensor
indexing per entry); on CUDA a write is a small asynchronous copy from pinned memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from thresher.serve_kernels.engine.sequence import Sequence


def consecutive(rows: list[int]) -> bool:
    """Whether ``rows`` are consecutive and in order (a steady decode batch): a view, not a
    gather. The endpoints are compared first, so most other batches cost no list."""
    return rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0],
                                                                      rows[0] + len(rows)))


class BlockTables:
    """``num_rows`` block tables of up to ``max_blocks`` entries each (int32, zero-padded)."""

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device):
        self.tables = torch.zeros(num_rows, max_blocks, dtype=torch.int32, device=device)
        self._host = self.tables.numpy() if self.tables.device.type == "cpu" else None
        self._address = self.tables.data_ptr()
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped lowest first

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def write(self, seq: Sequence, start: int) -> None:
        """Store ``seq.block_table[start:]`` in the sequence's row, taking a row if it has none."""
        if seq.table_row is None:
            if not self._free_rows:
                raise RuntimeError(f"no block-table row left for {seq.request_id!r}: more "
                                   f"sequences hold blocks than the {len(self.tables)} rows")
            seq.table_row = self._free_rows.pop()
        blocks = seq.block_table[start:]
        if not blocks:
            return
        end = start + len(blocks)
        if end > self.tables.shape[1]:
            self._widen(end)
        if self._host is not None:
            self._host[seq.table_row, start:end] = blocks
        else:
            src = torch.tensor(blocks, dtype=torch.int32).pin_memory()
            self.tables[seq.table_row, start:end].copy_(src, non_blocking=True)

    def _widen(self, width: int) -> None:
        """Make rows ``width`` entries long. The engine sizes rows for ``max_model_len``, so only
        a caller that bypasses admission (a probe of a longer prompt) gets here."""
        wider = self.tables.new_zeros(self.tables.shape[0], width)
        wider[:, : self.tables.shape[1]] = self.tables
        self.tables = wider
        self._host = wider.numpy() if wider.device.type == "cpu" else None
        self._address = wider.data_ptr()

    def clear_tail(self, seq: Sequence, start: int) -> None:
        """Zero the sequence's entries from ``start`` on (its table was cut there)."""
        if seq.table_row is None:
            return
        if self._host is not None:
            self._host[seq.table_row, start:] = 0
        else:
            self.tables[seq.table_row, start:].zero_()

    def release(self, seq: Sequence) -> None:
        """Zero the sequence's row and give it back."""
        row = seq.table_row
        if row is None:
            return
        if self._host is not None:
            self._host[row] = 0
        else:
            self.tables[row].zero_()
        self._free_rows.append(row)
        seq.table_row = None

    def gather(self, rows: torch.Tensor, width: int, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The tables of ``rows`` (a device index tensor), ``width`` entries each: [len, width]."""
        return torch.index_select(self.tables[:, :width], 0, rows, out=out)

    def host_rows(self, rows: list[int]) -> tuple[int, int] | None:
        """Where a CPU step's tables already lie: (address of the first row, row stride in
        entries) for consecutive rows in order, or one row repeated (stride 0), as
        ``batch_tables`` views them; None otherwise (a gather) or on a GPU."""
        if self._host is None:
            return None
        if consecutive(rows):
            stride = self._host.shape[1]
        elif rows.count(rows[0]) == len(rows):
            stride = 0
        else:
            return None
        return self._address + rows[0] * self._host.shape[1] * 4, stride

    def batch_tables(self, rows: list[int], row_idx: torch.Tensor, width: int) -> torch.Tensor:
        """A step's tables, at least ``width`` entries each. On a CPU, rows that are consecutive
        and in order (a steady decode batch: rows go out lowest first, in admission order) are
        a view of whole rows, with no copy (a 64 x 2,048 gather cost 0.1-0.3 ms); the kernels
        read each row only up to its length. One row repeated (the tokens of one sequence's
        speculative verify chunk, run as decode tokens) is that row broadcast (stride 0).
        Otherwise a gather."""
        if self._host is not None and consecutive(rows):
            return self.tables[rows[0] : rows[0] + len(rows)]
        if self._host is not None and rows.count(rows[0]) == len(rows):
            return self.tables[rows[0] : rows[0] + 1].expand(len(rows), -1)
        return self.gather(row_idx, width)
