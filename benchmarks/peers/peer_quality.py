"""Quality against a peer: thresher's GPTQ and AWQ beside llm-compressor's, same windows, one table.

    python benchmarks/peers/peer_quality.py --setup /path/to/llmc-venv      # once: build the peer venv
    python benchmarks/peers/peer_quality.py --peer-python /path/to/llmc-venv/bin/python \\
        --model demo:small --samples 64 --windows 64 --group-size 128 --bits 4 3 2

llm-compressor is never a thresher dependency: ``--setup`` makes a separate venv (torch's CPU
build first, so that pip does not pull a CUDA one, then the pinned llm-compressor) and
``peer_worker.py`` drives it there. Both sides calibrate on thresher's calibration windows
(thresher/data/windows.py) and are scored on the same held-out windows with the same perplexity
(token-level, non-overlapping); the unquantized model is scored on both sides first and the run
stops unless the two agree to 1e-4 relative. Settings, matched where both have the knob:

- GPTQ: symmetric grid, damping 0.01, block 128, act-order with groups fitted up front (thresher's
  ``act_order`` + ``static_groups``, llm-compressor's ``actorder: static``);
- AWQ: asymmetric grid, duo scaling; thresher clips weights (its default, as the AutoAWQ
  reference does), llm-compressor's AWQModifier has no clip search;
- MoE experts calibrated on their routed tokens (thresher's default; llm-compressor's
  ``moe_calibrate_all_experts=False``, its default being True); thresher's GPTQ counts each
  routed token once at 3 and 4 bits, as llm-compressor does, and weights it by its gate squared
  at 2 bits (``expert_weighting: auto``); routers, embeddings and lm_head stay unquantized on
  both sides.

thresher is scored from the artifact reloaded from disk, llm-compressor from the model ``oneshot``
returns, its fake-quantized weights (what its compressed-tensors checkpoint holds). Skips with a
message when the peer venv is not there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("peer_worker.py")
# what --setup installs; torch first from the machine's CPU build, pinned to thresher's
PEER_TORCH = "torch==2.13.0"
PEER_PACKAGE = "llmcompressor==0.14.0.1"
AGREEMENT = 1e-4  # relative difference allowed between the two sides' float perplexities


@dataclass(frozen=True)
class Row:
    method: str
    bits: int
    ours: float  # thresher's perplexity
    theirs: float  # llm-compressor's


def increase(p: float, base: float) -> float:
    """Perplexity increase over the unquantized model, in percent."""
    return 100 * (p / base - 1)


def format_table(rows: list[Row], fp_ours: float, fp_theirs: float) -> str:
    """The markdown table: per method and width both perplexities, both increases, their
    difference in percentage points (negative: thresher loses less) and the ratio of increases."""
    lines = ["| method | bits | thresher | vs float | llm-compressor | vs float | "
             "difference (pp) | increase ratio |", "|---|---|---|---|---|---|---|---|",
             f"| float | 32 | {fp_ours:.3f} | - | {fp_theirs:.3f} | - | - | - |"]
    for r in rows:
        a, b = increase(r.ours, fp_ours), increase(r.theirs, fp_theirs)
        ratio = f"{a / b:.2f}" if b > 0 else "-"
        lines.append(f"| {r.method} | {r.bits} | {r.ours:.3f} | {a:+.2f}% | {r.theirs:.3f} | "
                     f"{b:+.2f}% | {a - b:+.2f} | {ratio} |")
    return "\n".join(lines)


def setup(venv: Path) -> Path:
    """Create the peer venv (idempotent) and return its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for package in (PEER_TORCH, PEER_PACKAGE):
        subprocess.run([str(python), "-m", "pip", "install", "-q", package], check=True)
    return python


def peer(python: str, request: dict) -> dict:
    """One llm-compressor run in the peer venv; raises with its stderr's tail if it fails."""
    proc = subprocess.run([python, str(WORKER)], input=json.dumps(request), capture_output=True,
                          text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"peer worker failed (exit {proc.returncode}):\n{tail}")


def thresher_stage(method: str, bits: int, group_size: int):
    from thresher.recipe import QuantizeStage

    if method == "gptq":
        return QuantizeStage(method="gptq", bits=bits, group_size=group_size, act_order=True)
    return QuantizeStage(method="awq", bits=bits, group_size=group_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", type=Path, metavar="VENV",
                    help=f"create VENV with {PEER_TORCH} and {PEER_PACKAGE}, then exit")
    ap.add_argument("--peer-python", default=os.environ.get("LLMC_PYTHON"),
                    help="python of the llm-compressor venv (default: $LLMC_PYTHON)")
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--samples", type=int, default=64, help="calibration windows of 256 tokens")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    ap.add_argument("--methods", nargs="+", default=["gptq", "awq"], choices=["gptq", "awq"])
    ap.add_argument("--results", type=Path, default=None,
                    help="JSON file that keeps each finished run: a rerun with the same settings "
                    "skips them (a long run on a loaded machine can go on where it stopped)")
    args = ap.parse_args(argv)
    if args.setup:
        print(f"peer venv ready: {setup(args.setup)}")
        return 0
    if not args.peer_python or not Path(args.peer_python).exists():
        print(f"skipped: no llm-compressor venv (--peer-python {args.peer_python}); make one with "
              "`python benchmarks/peers/peer_quality.py --setup DIR`")
        return 0

    from thresher.compress.api import quantize_model
    from thresher.data.windows import calibration_windows, eval_windows
    from thresher.evaluate.perplexity import perplexity
    from thresher.models import load_model, load_tokenizer, resolve_model
    from thresher.models.quantized import dequantize_once, load_quantized_model
    from thresher.recipe import CalibrationConfig, PerplexityConfig

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    cal = CalibrationConfig(samples=args.samples)
    heldout = eval_windows(tok, PerplexityConfig(max_windows=args.windows))
    base = {"path": str(path), "calibration": calibration_windows(tok, cal).tolist(),
            "heldout": heldout.tolist(), "group_size": args.group_size}

    def score(model) -> float:
        return perplexity(model, heldout, show_progress=False).perplexity

    settings = f"{args.model} {args.samples} {args.windows} g{args.group_size}"
    done = json.loads(args.results.read_text()) if args.results and args.results.exists() else {}
    done = done.get(settings, {})

    def cached(key: str, compute) -> dict:
        if key not in done:
            done[key] = compute()
            if args.results:
                saved = json.loads(args.results.read_text()) if args.results.exists() else {}
                saved[settings] = done
                args.results.write_text(json.dumps(saved, indent=1))
        return done[key]

    fp_ours = cached("thresher float", lambda: {"perplexity": score(load_model(path))})
    fp_ours = fp_ours["perplexity"]
    float_peer = cached("peer float", lambda: peer(args.peer_python, {**base, "method": "float"}))
    fp_theirs = float_peer["perplexity"]
    gap = abs(fp_theirs / fp_ours - 1)
    print(f"model {args.model}, {args.samples} calibration windows x 256 tokens, "
          f"{heldout.shape[0]} held-out windows x 256, group size {args.group_size}; "
          f"peer {json.dumps(float_peer['versions'])}")
    print(f"float perplexity: thresher {fp_ours:.6f}, llm-compressor {fp_theirs:.6f} "
          f"(relative difference {gap:.1e})", flush=True)
    if gap > AGREEMENT:
        print("the two sides do not compute the same perplexity; stopping")
        return 1
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for bits in args.bits:
            for method in args.methods:
                def ours(method: str = method, bits: int = bits) -> dict:
                    out = Path(tmp) / f"{method}-{bits}"
                    start = time.perf_counter()
                    quantize_model(path, thresher_stage(method, bits, args.group_size), cal, out,
                                   show_progress=False)
                    seconds = time.perf_counter() - start
                    return {"perplexity": score(dequantize_once(load_quantized_model(out))),
                            "seconds": seconds}

                a = cached(f"thresher {method} {bits}", ours)
                b = cached(f"peer {method} {bits}", lambda method=method, bits=bits: peer(
                    args.peer_python, {**base, "method": method, "bits": bits,
                                       "symmetric": method == "gptq"}))
                rows.append(Row(method, bits, a["perplexity"], b["perplexity"]))
                print(f"{method} {bits}-bit: thresher {a['perplexity']:.3f} ({a['seconds']:.0f} s "
                      f"quantize), llm-compressor {b['perplexity']:.3f} ({b['seconds']:.0f} s "
                      "oneshot)", flush=True)
    print("\n" + format_table(rows, fp_ours, fp_theirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
