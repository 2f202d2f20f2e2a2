"""The validation run of a published artifact, in the engine that serves it.

Three checks, all through the serving path rather than transformers: held-out perplexity from the
engine's prompt log-probabilities (the same windows and convention as the flow's evaluation, so
the two numbers should agree); greedy agreement with the uncompressed base model over a fixed
prompt set; and a load test over HTTP against the real server at each configured concurrency.
The flow logs the returned ``validate/...`` metrics to the variant's MLflow run.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from pathlib import Path

from thresher.data.windows import eval_windows
from thresher.recipe import PerplexityConfig, ValidateConfig
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.loadtest import load_test
from thresher.serve_kernels.server import BackgroundServer, ServerConfig, build_app

log = logging.getLogger(__name__)

# Fixed prompts for greedy agreement and the load test: code (what the demo models know) and prose.
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self",
    "def parse_args(args=None):\n    parser = argparse.ArgumentParser(",
    "    for key, value in sorted(mapping.items()):\n        if ",
    "try:\n    import _thread\nexcept ImportError:\n    ",
    "The quick brown fox jumps over the lazy dog. The",
    "# Copyright 2001 Python Software Foundation.\n\"\"\"Utilities for",
    "    def __repr__(self):\n        return '%s(%r)' % (",
]

_base_outputs: dict[tuple[str, int, str], list[list[int]]] = {}


def engine_perplexity(llm, windows: list[list[int]]) -> tuple[float, float, int]:
    """(perplexity, mean NLL, tokens scored) from the engine's prompt log-probabilities.

    Each window of n tokens scores its n - 1 next-token predictions, as
    ``thresher.evaluate.perplexity`` does.
    """
    total, tokens = 0.0, 0
    for logprobs in llm.score(windows):
        scored = [lp for lp in logprobs[1:] if lp is not None]
        if len(scored) != len(logprobs) - 1:
            raise ValueError("the engine returned no log-probability for some prompt tokens")
        total -= sum(scored)
        tokens += len(scored)
    nll = total / tokens
    return math.exp(nll), nll, tokens


def greedy_tokens(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The greedy continuation of every prompt, ``max_tokens`` long (end-of-sequence ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def token_agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions where the tokens match, mean fraction before the first mismatch)."""
    matches = total = 0
    prefix = 0.0
    for a, b in zip(got, want, strict=True):
        n = max(len(a), len(b))
        matches += sum(x == y for x, y in zip(a, b, strict=False))
        total += n
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
        prefix += first / n if n else 1.0
    return matches / total, prefix / len(want)


def _base_greedy(base_dir: Path, max_tokens: int, dtype: str) -> list[list[int]]:
    """The base model's greedy continuations (computed once per process and base model)."""
    key = (str(Path(base_dir).resolve()), max_tokens, dtype)
    if key not in _base_outputs:
        log.info("validation: greedy continuations of the base model %s", base_dir)
        base = LLM(base_dir, dtype=dtype)
        _base_outputs[key] = greedy_tokens(base, PROMPTS, max_tokens)
        del base
        gc.collect()
    return _base_outputs[key]


def validate_artifact(artifact_dir: str | Path, base_dir: str | Path, eval_cfg: PerplexityConfig,
                      validate_cfg: ValidateConfig, dtype: str = "float32") -> dict[str, float]:
    """Load ``artifact_dir`` in the engine and measure quality and service; ``validate/...`` keys."""
    artifact_dir = Path(artifact_dir)
    concurrency = sorted(set(validate_cfg.concurrency))
    start = time.perf_counter()
    llm = LLM(artifact_dir, dtype=dtype, max_num_seqs=max(concurrency))
    metrics = {"validate/load_seconds": time.perf_counter() - start}
    info = llm.engine.model_info
    for key in ("weight_bytes", "kv_cache_bytes"):
        if isinstance(info.get(key), int | float):
            metrics[f"validate/{key}"] = float(info[key])

    windows = eval_windows(llm.engine.tokenizer, eval_cfg).tolist()
    log.info("validation of %s: perplexity on %d evaluation windows", artifact_dir.name, len(windows))
    start = time.perf_counter()
    ppl, nll, tokens = engine_perplexity(llm, windows)
    metrics.update({"validate/perplexity": ppl, "validate/nll": nll,
                    "validate/eval_tokens": float(tokens),
                    "validate/score_seconds": time.perf_counter() - start})

    log.info("validation of %s: greedy agreement with the base model", artifact_dir.name)
    own = greedy_tokens(llm, PROMPTS, validate_cfg.max_tokens)
    if Path(base_dir).resolve() == artifact_dir.resolve():
        base = own
    else:
        base = _base_greedy(Path(base_dir), validate_cfg.max_tokens, dtype)
    metrics["validate/agreement"], metrics["validate/agreement_prefix"] = token_agreement(own, base)

    name = artifact_dir.name
    app = build_app(llm.engine, ServerConfig(served_model_name=name,
                                             max_num_seqs=max(concurrency),
                                             max_queue=max(concurrency)))
    with BackgroundServer(app) as server:
        for c in concurrency:
            result = load_test(server.url, name, PROMPTS, c, c * validate_cfg.rounds,
                               validate_cfg.max_tokens)
            summary = result.summary()
            log.info("validation of %s: concurrency %d: %.1f tok/s, TTFT p50 %.0f ms, "
                     "TPOT p50 %.1f ms", name, c, summary["throughput_tok_s"],
                     summary["ttft_p50_ms"], summary["tpot_p50_ms"])
            metrics[f"validate/throughput_c{c}_tok_s"] = summary["throughput_tok_s"]
            for stat in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
                metrics[f"validate/{stat}_c{c}"] = summary[stat]
    del llm, app
    gc.collect()
    return metrics
