"""llama.cpp as the runtime that checks an exported GGUF file: logits and greedy decoding.

llama.cpp comes from ``llama-cpp-python``, an optional extra (``pip install thresher[llama]`` or
``make llama``) because it builds llama.cpp from source with cmake and g++, about 18 minutes on a
2-core machine. The logits function has the shape thresher's perplexity takes (ids [B, S] ->
logits [B, S, V]), so llama.cpp's perplexity of a file and thresher's of the same weights are
computed by the same code on the same windows.

llama.cpp's CPU "extra buffer types" are turned off for every model loaded here when llama.cpp
was built with its AMX code (``use_extra_bufts = False``, llama.cpp's ``--no-repack``). Built with
GCC 12 on a CPU with AMX,
ggml-cpu's AMX buffer type takes the Q4_0, Q4_1 and Q8_0 matrices, and its tile setup
(``ggml_tile_config_init``) fills a 64-byte config on the stack that GCC 12's ``_tile_loadconfig``
declares as an 8-byte read: the compiler drops the stores of the tile shapes, ``ldtilecfg`` loads
stack garbage, and the first quantized matmul dies with SIGSEGV. Without extra buffer types those
matrices take ggml's plain CPU path, which also loses the repacked Q4_0 kernels (docs/gguf.md gives
the cost); a llama.cpp built without AMX (docs/gguf.md) keeps its defaults, repacking included.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from thresher.errors import ExportError

LLAMA_CPP_AVAILABLE = importlib.util.find_spec("llama_cpp") is not None
INSTALL_HINT = ("llama-cpp-python is not installed: `make llama` or `pip install thresher[llama]` "
                "builds llama.cpp from source (about 18 minutes on 2 cores)")


@dataclass(frozen=True)
class DecodeTiming:
    """Greedy decoding of one prompt: tokens generated and the decode rate after the prompt."""

    tokens: int
    prompt_seconds: float
    decode_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else 0.0


_PARAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_extra_buffer_types() -> Iterator[None]:
    """While a ``Llama`` is built, its model params come with ``use_extra_bufts`` off:
    llama-cpp-python's constructor takes no such argument and reads llama.cpp's defaults."""
    from llama_cpp import llama as module

    defaults = module.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    with _PARAMS_LOCK:
        module.llama_cpp.llama_model_default_params = params
        try:
            yield
        finally:
            module.llama_cpp.llama_model_default_params = defaults


def amx_build() -> bool:
    """Whether the installed llama.cpp was compiled with ggml's AMX code (its system info)."""
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()


class LlamaCppModel:
    """One GGUF file loaded in llama.cpp on the CPU, every position's logits kept (``logits``
    needs them; ``logits_all=False`` keeps the last only, as a prompt is served)."""

    def __init__(self, path: str | Path, n_ctx: int = 512, n_threads: int | None = None,
                 logits_all: bool = True):
        if not LLAMA_CPP_AVAILABLE:
            raise ExportError(INSTALL_HINT)
        from llama_cpp import Llama

        self.path = Path(path)
        with _without_extra_buffer_types() if amx_build() else contextlib.nullcontext():
            self.llm = Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                             logits_all=logits_all, n_threads=n_threads,
                             n_threads_batch=n_threads,
                             verbose=False)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, V] of each row of ``ids`` [B, S], evaluated from an empty cache (no BOS
        is added: the rows are scored exactly as given)."""
        out = []
        for row in ids.tolist():
            self.llm.reset()
            self.llm.eval(row)
            out.append(torch.from_numpy(np.array(self.llm.scores[:len(row)], dtype=np.float32)))
        return torch.stack(out)

    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], DecodeTiming]:
        """The ``max_tokens`` greedy continuation of ``prompt`` (no stop token), and its timing."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        prompt_seconds = time.perf_counter() - start
        out: list[int] = []
        start = time.perf_counter()
        for _ in range(max_tokens):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(token)
            self.llm.eval([token])
        return out, DecodeTiming(len(out), prompt_seconds, time.perf_counter() - start)

    def close(self) -> None:
        self.llm.close()
