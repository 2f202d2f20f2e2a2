"""Wall time and peak resident memory of a piece of work, for the stage metrics."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) for this process, where Linux allows it."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Usage:
    wall_seconds: float = 0.0
    peak_rss_mb: float = 0.0


@contextlib.contextmanager
def measure() -> Iterator[Usage]:
    """Measure the enclosed block: wall seconds and the process's peak RSS while it ran."""
    usage = Usage()
    _reset_peak()
    start = time.perf_counter()
    try:
        yield usage
    finally:
        usage.wall_seconds = time.perf_counter() - start
        usage.peak_rss_mb = _peak_rss_mb()
