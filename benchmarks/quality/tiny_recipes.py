"""Train variants of the `tiny` demo recipe and measure the orderings the algorithm tests assert.

    .venv/bin/python benchmarks/quality/tiny_recipes.py --out /tmp/tiny-recipes \\
        '{"steps": 420, "seq_len": 128, "aux_loss_coef": 0.1, "seed": 1}' '{"seed": 0}' ...

Each argument is a JSON object of `DemoSpec` fields that replace `tiny`'s. Every variant is
trained into OUT (not the cache), then measured with the tests' exact settings: pruning as in
tests/prune/test_quality.py (32 calibration windows of 256 tokens, 32 held-out windows), and
in-memory quantization as in tests/compress/test_quality.py (same calibration, 24 held-out
windows, AWQ with clipping), as the perplexity increase over float in %. Prints one markdown row
per variant; docs/benchmarks.md ("Choosing the `tiny` recipe") holds the rows measured so far.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from thresher.compress.api import quantize_in_memory
from thresher.data import demo_model
from thresher.data.windows import calibration_windows
from thresher.evaluate.perplexity import heldout_perplexity
from thresher.formats.artifact import DEMO_MODEL_META
from thresher.models import load_model, load_tokenizer
from thresher.models.layerwise import LayerwiseModel
from thresher.prune.api import prune_model
from thresher.prune.observer import observe_experts
from thresher.recipe import CalibrationConfig, PerplexityConfig, PruneStage, QuantizeStage

CAL = CalibrationConfig(samples=32, seq_len=256)
PRUNE = [("reap", 0.5), ("frequency", 0.5), ("ean", 0.5), ("random", 0.5), ("reap", 0.25)]
QUANT = [(3, -1), (2, 64), (2, -1)]  # (bits, group size): the settings the tests assert


def ppl(model, tokenizer, cfg: PerplexityConfig) -> float:
    return heldout_perplexity(model, cfg, tokenizer=tokenizer, show_progress=False).perplexity


def train(overrides: dict, out: Path) -> tuple[Path, float]:
    """The variant's checkpoint (trained unless OUT already holds it) and its training seconds."""
    spec = dataclasses.replace(demo_model.SPECS["tiny"], **overrides)
    path = demo_model.build_from_spec(spec, out / f"tiny-{demo_model.demo_key(spec)}")
    return path, float(json.loads((path / DEMO_MODEL_META).read_text())["train_seconds"])


def measure(path: Path) -> dict[str, float]:
    tok = load_tokenizer(path)
    result: dict[str, float] = {}
    heldout = PerplexityConfig(max_windows=32)
    observed = observe_experts(LayerwiseModel(path), calibration_windows(tok, CAL),
                               show_progress=False)
    base_model = load_model(path)
    result["ppl"] = ppl(base_model, tok, heldout)
    for method, ratio in PRUNE:
        pruned = path.parent / f"{path.name}-{method}{ratio}"
        prune_model(path, PruneStage(method=method, ratio=ratio, seed=0), CAL, pruned,
                    observed=observed, show_progress=False)
        result[f"{method}{int(ratio * 100)}"] = ppl(load_model(pruned), tok, heldout)
    heldout = PerplexityConfig(max_windows=24)
    base = ppl(base_model, tok, heldout)
    for bits, group in QUANT:
        for method in ("rtn", "gptq", "awq"):
            stage = QuantizeStage(method="rtn").model_copy(update={
                "method": method, "bits": bits, "group_size": group,
                **({"clip": True} if method == "awq" else {})})
            model, _ = quantize_in_memory(path, stage, CAL)
            result[f"{method}{bits}g{group}"] = 100 * (ppl(model, tok, heldout) - base) / base
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", help="JSON objects of DemoSpec fields")
    parser.add_argument("--out", type=Path, default=Path("/tmp/tiny-recipes"))
    args = parser.parse_args()
    quant_cols = [f"{b}-bit {'per row' if g < 0 else f'g{g}'} RTN / GPTQ / AWQ" for b, g in QUANT]
    print("| overrides | train s | ppl | REAP 50% | freq 50% | EAN 50% | random 50% | REAP 25% | "
          + " | ".join(quant_cols) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + "---|" * len(QUANT))
    for text in args.variants:
        path, seconds = train(json.loads(text), args.out)
        r = measure(path)
        quant = [" / ".join(f"{r[f'{m}{b}g{g}']:+.2f}" for m in ("rtn", "gptq", "awq"))
                 for b, g in QUANT]
        print(f"| `{text}` | {seconds:.0f} | {r['ppl']:.2f} | {r['reap50']:.2f} | "
              f"{r['frequency50']:.2f} | {r['ean50']:.2f} | {r['random50']:.2f} | "
              f"{r['reap25']:.2f} | " + " | ".join(quant) + " |", flush=True)


if __name__ == "__main__":
    main()
