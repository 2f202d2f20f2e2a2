"""The validation run over the demo recipe's variants: engine perplexity, agreement, load test.

    .venv/bin/python benchmarks/engine/load_test.py [--model demo:tiny] [--recipe configs/demo.yaml]
        [--concurrency 1 4 16] [--max-tokens 64] [--rounds 2] [--work DIR]

Builds every variant of the recipe with the stage APIs (prefixes shared, cached under --work),
then runs ``validate_artifact`` on each: the artifact in the engine, the real server on a loopback
port, streaming clients at each concurrency. Prints markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

from thresher.models import resolve_model
from thresher.recipe import PerplexityConfig, ValidateConfig, load_recipe
from thresher.serve_kernels.validate import validate_artifact

ROOT = Path(__file__).resolve().parents[2]


def build_variants(model: str, recipe_path: Path, work: Path,
                   group_size: int | None) -> dict[str, Path]:
    """Each variant's artifact directory, computing the stages not yet in ``work``."""
    from thresher.compress.api import quantize_model
    from thresher.prune.api import prune_model

    recipe = load_recipe(recipe_path)
    for variant in recipe.variants:
        for stage in variant.stages:
            if group_size and stage.quantize is not None and stage.quantize.method != "nf4":
                stage.quantize.group_size = group_size
    base = resolve_model(model)
    out = {}
    for variant in recipe.variants:
        path, key = base, str(base)
        for stage in variant.stages:
            key = hashlib.sha256((key + stage.model_dump_json()).encode()).hexdigest()[:16]
            target = work / f"{stage.kind}-{key}"
            if not (target / "config.json").is_file():
                logging.info("%s: %s", variant.name, stage.describe())
                if stage.prune is not None:
                    prune_model(path, stage.prune, recipe.calibration, target)
                else:
                    quantize_model(path, stage.quantize, recipe.calibration, target)
            path = target
        out[variant.name] = path
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo:tiny")
    parser.add_argument("--recipe", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--windows", type=int, default=32, help="held-out windows of 256 tokens")
    parser.add_argument("--group-size", type=int, default=None,
                        help="override the recipe's group size (tiny: 64 divides every layer)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/thresher-load-test"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if args.model.startswith("demo:"):
        from thresher.data.demo_model import build_demo_model

        build_demo_model(args.model.removeprefix("demo:"))
    variants = build_variants(args.model, args.recipe, args.work, args.group_size)
    base = variants.get("base", resolve_model(args.model))
    eval_cfg = PerplexityConfig(seq_len=256, max_windows=args.windows)
    validate_cfg = ValidateConfig(concurrency=args.concurrency, max_tokens=args.max_tokens,
                                  rounds=args.rounds)
    results = {}
    for name, path in variants.items():
        start = time.perf_counter()
        results[name] = validate_artifact(path, base, eval_cfg, validate_cfg)
        logging.info("%s validated in %.0f s", name, time.perf_counter() - start)

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
          f"torch threads, python {platform.python_version()}, torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"model {args.model}, recipe {args.recipe.name}"
          + (f" with group size {args.group_size}" if args.group_size else "")
          + f"; {args.max_tokens} tokens per request (ignore_eos, greedy), "
          f"{args.rounds} requests per client; perplexity on {args.windows} x 256 held-out tokens\n")
    print("| variant | weights (MB) | engine ppl | agreement | agreement (prefix) |")
    print("|---|---|---|---|---|")
    for name, m in results.items():
        print(f"| {name} | {m.get('validate/weight_bytes', float('nan')) / 1e6:.2f} | "
              f"{m['validate/perplexity']:.2f} | {m['validate/agreement']:.3f} | "
              f"{m['validate/agreement_prefix']:.3f} |")
    print()
    print("| variant | concurrency | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
          "| TPOT p99 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for name, m in results.items():
        for c in sorted(set(args.concurrency)):
            print(f"| {name} | {c} | {m[f'validate/throughput_c{c}_tok_s']:.1f} | "
                  f"{m[f'validate/ttft_p50_ms_c{c}']:.0f} | {m[f'validate/ttft_p99_ms_c{c}']:.0f} | "
                  f"{m[f'validate/tpot_p50_ms_c{c}']:.1f} | {m[f'validate/tpot_p99_ms_c{c}']:.1f} |")


if __name__ == "__main__":
    main()
