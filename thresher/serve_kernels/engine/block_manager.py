"""The paged KV cache's bookkeeping: which block holds which tokens, who uses it, what to evict.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence's block table lists
its blocks in order, so token i lives at slot ``block_table[i // block_size] * block_size +
i % block_size``.

Prefix caching (as in vLLM): once a block is full its content is identified by a chain hash,
hash(parent block's hash, its token ids), so equal hashes mean equal prefixes. A new sequence
walks its prompt block by block and reuses every block whose hash is known (reference count + 1)
until the first miss. A block whose count drops to 0 keeps its content and hash and waits in an
LRU list of cached free blocks; it is reused on a later hit, or evicted (its hash forgotten) only
when a fresh block is needed and no never-used block is left. Blocks are released tail first, so
the tail of a finished sequence is evicted before the prefix it may share with others.

Every change to a sequence's block table is written to its row of the persistent
``BlockTables`` at once, so a step never rebuilds the tables from these lists.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from thresher.serve_kernels.engine.block_table import BlockTables
from thresher.serve_kernels.engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Content hash of a full block given the hash of the block before it."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """Allocation, sharing and eviction of KV-cache blocks."""

    def __init__(self, num_blocks: int, block_size: int, tables: BlockTables,
                 enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.tables = tables
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.fresh: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self.cached: OrderedDict[int, None] = OrderedDict()  # free with content, LRU first

    # -- accounting --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.fresh) + len(self.cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # -- allocation --------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self.fresh:
            return self.fresh.popleft()
        block, _ = self.cached.popitem(last=False)  # evict the least recently freed
        del self.hash_to_block[self.hashes[block]]
        self.hashes[block] = None
        return block

    def match_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its longest cached prefix; return its tokens.

        At least one token is left to compute (its logits give the next token), and a request
        for prompt log-probs computes every position, so it takes no hits.
        """
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return 0
        bs = self.block_size
        parent = b""
        for i in range((seq.num_tokens - 1) // bs):
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else block_hash(
                parent, seq.token_ids[i * bs : (i + 1) * bs])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.cached[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            if i == len(seq.block_hashes):
                seq.block_hashes.append(h)
            parent = h
        if seq.block_table:
            self.tables.write(seq, 0)
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Add the blocks that ``num_new_tokens`` more computed tokens need; False if too few."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        missing = needed - len(seq.block_table)
        if missing > self.num_free_blocks:
            return False
        if missing > 0:
            start = len(seq.block_table)
            for _ in range(missing):
                block = self._take_free_block()
                self.ref_counts[block] = 1
                seq.block_table.append(block)
            self.tables.write(seq, start)
        return True

    def commit(self, seq: Sequence) -> None:
        """Hash and publish the blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else b""
            h = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.hashes[block] is None and h not in self.hash_to_block:
                self.hashes[block] = h
                self.hash_to_block[h] = block

    def truncate(self, seq: Sequence) -> None:
        """Release the tail blocks past ``seq.num_computed_tokens`` (speculative tokens the
        target rejected). Their slots hold no committed token, so no hash names them."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if keep >= len(seq.block_table):
            return
        for block in reversed(seq.block_table[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.fresh.append(block)
        self.tables.clear_tail(seq, keep)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first; hashed blocks stay cached for reuse."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hashes[block] is None:
                    self.fresh.append(block)
                else:
                    self.cached[block] = None
        self.tables.release(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
