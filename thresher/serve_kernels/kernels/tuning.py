"""Tile configurations chosen per shape on the GPU, fixed everywhere else.

One shipped tile per kernel and phase either spills registers or under-fills the machine for some
shape (a 128 x 128 dequantized tile on 4 warps holds 128 fp32 values per thread; at N = 4096 a
GEMV of 128-column tiles launches 128 programs for 132 SMs). So on a CUDA device the first call of
a kernel at a new shape times each candidate configuration (CUDA events, a few calls each) and
keeps the fastest for that shape, as Triton's autotuner would; the timing happens eagerly before
any CUDA graph is captured (the model runner's warm-up pass), and a shape first met during a
capture takes the default. Candidates that fail to compile or launch (out of shared memory) are
skipped. On the CPU (the interpreter tests and the engine's reference path) every call takes the
default, so results there never depend on timing. ``THRESHER_AUTOTUNE=0`` keeps the defaults on
a GPU too.

Inside an engine step (``serving``) nothing is timed: compiling and timing a dozen tiles takes
seconds, and a request must not wait for them. A shape first met there (a prompt length not
seen at start-up, a prefill that meets the prefix cache and has fewer new rows) takes the tile
chosen for the nearest row count of the same matrix, else the default. The engine's start-up
forwards (KV-cache sizing at the largest batch, a warm-up at every decode batch size, graphed
or eager) run outside steps and time theirs.

Unlike ``triton.autotune`` the grid and the split-K output buffer depend on the configuration,
and the choice must be reportable (``benchmarks/scale/gpu_suite.py`` prints ``chosen()``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from thresher.serve_kernels.kernels.backend import TileConfig

log = logging.getLogger(__name__)

ENV_VAR = "THRESHER_AUTOTUNE"
_TUNERS: dict[str, Tuner] = {}
_SERVING = 0  # engine steps in progress (``serving``)


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def fastest(candidates: Sequence[TileConfig], run: Callable[[TileConfig], object],
            seconds: Callable[[Callable[[], object]], float]) -> TileConfig | None:
    """The candidate whose ``run`` takes least time by ``seconds``; None if every one fails."""
    best, best_time = None, math.inf
    for cfg in candidates:
        try:
            took = seconds(lambda cfg=cfg: run(cfg))
        except Exception as exc:  # noqa: BLE001 - Triton raises OutOfResources, CompilationError
            log.debug("tile %s skipped: %s", cfg, exc)
            continue
        if took < best_time:
            best, best_time = cfg, took
    return best


def cuda_seconds(fn: Callable[[], object], calls: int = 10) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream (one warm-up call, which compiles)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


@dataclass
class Tuner:
    """One kernel's candidates and the configuration chosen for each shape key."""

    name: str
    chosen: dict[tuple, TileConfig] = field(default_factory=dict)

    def pick(self, key: tuple, x: torch.Tensor, default: TileConfig,
             candidates: Sequence[TileConfig], run: Callable[[TileConfig], object]) -> TileConfig:
        """The configuration for ``key``: timed once per key on a CUDA device, else ``default``."""
        if not x.is_cuda or not enabled():
            return default
        cfg = self.chosen.get(key)
        if cfg is not None:
            return cfg
        if torch.cuda.is_current_stream_capturing():
            return default
        if _SERVING:
            return self.nearest(key, default) or default
        cfg = fastest([default, *(c for c in candidates if c != default)], run, cuda_seconds)
        self.chosen[key] = cfg = cfg or default
        log.info("%s %s: tile %s", self.name, key, cfg)
        return cfg

    def nearest(self, key: tuple, default: TileConfig) -> TileConfig | None:
        """The tile chosen for the same matrix (``key[1:]``) at the row count (``key[0]``, an
        ``m_bucket``) nearest ``key``'s on a log scale, among those with ``default``'s rows per
        tile (a decode tile of 16 rows would re-read the weights 4x over a prefill's 64) and K
        tile (a grouped kernel's must lie in one group); None if none was."""
        same = [(abs(math.log2(max(k[0], 1)) - math.log2(max(key[0], 1))), k[0], cfg)
                for k, cfg in self.chosen.items() if k[1:] == key[1:]
                and (cfg.block_m, cfg.block_k) == (default.block_m, default.block_k)]
        return min(same, key=lambda t: t[:2])[2] if same else None


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """An engine step: shapes first met inside it are not timed (module docstring)."""
    global _SERVING
    _SERVING += 1
    try:
        yield
    finally:
        _SERVING -= 1


def tuner(name: str) -> Tuner:
    """The process-wide tuner of kernel ``name``."""
    if name not in _TUNERS:
        _TUNERS[name] = Tuner(name)
    return _TUNERS[name]


def chosen() -> dict[str, dict[tuple, TileConfig]]:
    """Every configuration chosen so far, by kernel and shape key."""
    return {name: dict(t.chosen) for name, t in _TUNERS.items() if t.chosen}


def describe(cfg: TileConfig) -> str:
    """A configuration as ``MxNxK/split/warps/stages``."""
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/s{cfg.split_k}/w{cfg.num_warps}"
            f"/st{cfg.num_stages}")


def m_bucket(m: int) -> int:
    """Rows keyed exactly up to 16 (decode batches), then by the next power of two."""
    return m if m <= 16 else 1 << (m - 1).bit_length()


def variants(base: TileConfig, **choices: Sequence[int]) -> list[TileConfig]:
    """``base``, then ``base`` with each combination of the given fields (block_n=(64, 128), ...)."""
    out = [base]
    for name, values in choices.items():
        out = [TileConfig(**{**vars(c), name: v}) for c in out for v in values]
    return list(dict.fromkeys([base, *out]))
