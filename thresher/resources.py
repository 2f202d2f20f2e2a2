"""Wall time and peak resident memory of a piece of work: the one definition of "peak memory";
and the memory a new allocation can still get (``available_memory``).

CLI reports, flow metrics and benchmarks all read it from here, so the same work reports the same
number wherever it runs. On Linux the peak is the kernel's VmHWM, reset at the start of the block
(``/proc/self/clear_refs``); elsewhere it falls back to the process-lifetime ``ru_maxrss``. Work on
a CUDA device also reports the device's peak: PyTorch's ``max_memory_allocated``, reset likewise;
on the CPU there is no second number (None), the host's peak being the whole story.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: a container's memory limit


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) for this process, where Linux allows it."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """The process's peak resident set (MiB) since the last ``reset_peak``."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_device_peak(device: torch.device | None) -> None:
    """Reset the peak-memory counter of a CUDA ``device`` (nothing to do for the CPU)."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def device_peak_mb(device: torch.device | None) -> float | None:
    """Peak memory allocated on a CUDA ``device`` (MiB) since the last ``reset_device_peak``;
    None for the CPU."""
    if device is None or device.type != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**20


@dataclass
class Usage:
    wall_seconds: float = 0.0
    peak_rss_mb: float = 0.0
    peak_device_mb: float | None = None  # CUDA work only


@contextlib.contextmanager
def measure(device: torch.device | None = None) -> Iterator[Usage]:
    """Measure the enclosed block: wall seconds and the process's peak RSS while it ran (and
    the peak allocated on ``device`` when that is a CUDA device)."""
    usage = Usage()
    reset_peak()
    reset_device_peak(device)
    start = time.perf_counter()
    try:
        yield usage
    finally:
        usage.wall_seconds = time.perf_counter() - start
        usage.peak_rss_mb = peak_rss_mb()
        usage.peak_device_mb = device_peak_mb(device)


def available_memory() -> tuple[int, str] | None:
    """Bytes this process can still allocate before the kernel's OOM killer steps in, and where
    the bound comes from: MemAvailable plus free swap, capped by a cgroup v2 memory limit (a
    container's) less the memory charged to it that is not page cache (page cache is reclaimed
    on demand, so counting it would refuse work that fits). None where /proc/meminfo cannot be
    read (not Linux)."""
    try:
        info = {}
        for line in _MEMINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
        free, where = info["MemAvailable"] + info.get("SwapFree", 0), "free memory and swap"
    except (OSError, ValueError, KeyError, IndexError):
        return None
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            used = int((_CGROUP / "memory.current").read_text())
            stat = dict(line.split() for line in (_CGROUP / "memory.stat").read_text().splitlines())
            room = int(limit) - (used - int(stat.get("file", 0)))
            if room < free:
                free, where = room, "this container's memory limit"
    except (OSError, ValueError):
        pass
    return max(free, 0), where
