"""How many KV-cache blocks the engine allocates: a given count, a size in GiB, or what a GPU has.

On a GPU the cache takes what the engine's share leaves (vLLM's per-instance meaning):
``gpu_memory_utilization`` of the device's total memory, less what this engine holds (weights,
states, a draft model, memory the driver took outside torch since the engine started) and the
activations' peak, which a profiling forward of the largest step (``max_num_batched_tokens``
prompt tokens) shows. Other processes' memory does not shrink the share (two engines at 0.45 share
a device), but the cache never takes more than the device has free. On a CPU the default is a
fixed budget (``KV_BUDGET_BYTES``), capped at what ``max_num_seqs`` full-length sequences can
use, as before this module existed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

KV_BUDGET_BYTES = 1 << 30  # CPU default when neither num_kv_blocks nor kv_cache_gb is given


@dataclass(frozen=True)
class KVCacheConfig:
    """The user's KV-cache options; at most one of ``num_blocks`` and ``cache_gb`` is set."""

    num_blocks: int | None = None
    cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.cache_gb is not None:
            raise ValueError("num_kv_blocks and kv_cache_gb both set: give one of them")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_blocks}: must be >= 1")
        if self.cache_gb is not None and not self.cache_gb > 0:
            raise ValueError(f"kv_cache_gb={self.cache_gb}: must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must lie in "
                             "(0, 1]")


@dataclass(frozen=True)
class GPUMemory:
    """A device's memory at one moment: the driver's view and torch's."""

    total: int
    free: int
    allocated: int  # by this process's torch tensors
    reserved: int  # by this process's torch caching allocator

    @classmethod
    def read(cls, device: torch.device) -> GPUMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_allocated(device),
                   torch.cuda.memory_reserved(device))


def kv_cache_budget(start: GPUMemory, now: GPUMemory, transient: int, utilization: float) -> int:
    """Bytes for the KV cache: the engine's share of the device, less what it has taken since
    ``start`` (tensors, and the driver's use outside torch's pool) and the activations' peak
    (``transient``), and at most the free memory less that peak."""
    outside_torch = ((now.total - now.free) - (start.total - start.free)
                     - (now.reserved - start.reserved))
    own = now.allocated - start.allocated + max(0, outside_torch)
    share = int(now.total * utilization) - own - transient
    return min(share, now.free - transient)


def free_gpu_bytes(device: torch.device, utilization: float, start: GPUMemory,
                   profile_forward: Callable[[], None]) -> int:
    """Bytes left for the KV cache after ``profile_forward`` (the largest step) has run;
    ``start`` is the device's memory before the engine loaded anything."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the profile's freed blocks would otherwise count as in use
    stats = torch.cuda.memory_stats(device)
    transient = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    now = GPUMemory.read(device)
    budget = kv_cache_budget(start, now, transient, utilization)
    log.info("GPU memory: %.1f GiB total, %.1f GiB free, this engine %.1f GiB, activation peak "
             "%.1f GiB -> %.1f GiB for the KV cache", now.total / 2**30, now.free / 2**30,
             (now.allocated - start.allocated) / 2**30, transient / 2**30, budget / 2**30)
    return max(0, budget)


def size_kv_cache(cfg: KVCacheConfig, bytes_per_block: int, blocks_per_seq: int,
                  max_num_seqs: int, gpu_free_bytes: Callable[[], int] | None) -> int:
    """The block count: given, from ``cache_gb``, from the GPU's free memory, or the CPU default.

    ``gpu_free_bytes`` (None on a CPU) is called only when the count must come from the GPU."""
    if cfg.num_blocks is not None:
        blocks = cfg.num_blocks
    elif cfg.cache_gb is not None:
        blocks = int(cfg.cache_gb * 2**30) // bytes_per_block
    elif gpu_free_bytes is not None:
        blocks = gpu_free_bytes() // bytes_per_block
    else:
        blocks = max(blocks_per_seq,
                     min(max_num_seqs * blocks_per_seq, KV_BUDGET_BYTES // bytes_per_block))
    return blocks
