"""Wall time and peak resident memory of a piece of work: the one definition of "peak memory".

CLI reports, flow metrics and benchmarks all read it from here, so the same work reports the same
number wherever it runs. On Linux the peak is the kernel's VmHWM, reset at the start of the block
(``/proc/self/clear_refs``); elsewhere it falls back to the process-lifetime ``ru_maxrss``.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


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


@dataclass
class Usage:
    wall_seconds: float = 0.0
    peak_rss_mb: float = 0.0


@contextlib.contextmanager
def measure() -> Iterator[Usage]:
    """Measure the enclosed block: wall seconds and the process's peak RSS while it ran."""
    usage = Usage()
    reset_peak()
    start = time.perf_counter()
    try:
        yield usage
    finally:
        usage.wall_seconds = time.perf_counter() - start
        usage.peak_rss_mb = peak_rss_mb()
