"""Speculative decoding against plain decoding, in one run, on the generative task's prompts.

    PYTHONPATH=. python benchmarks/engine/speculative.py [--model demo:small] [--prompts 8]
        [--max-tokens 64] [--k 2 3 4 5 6 7 8] [--draft DIR ...] [--threads 2] [--no-llama]
    PYTHONPATH=. python benchmarks/engine/speculative.py --model moe-1g --dtype bfloat16

Decodes the first ``--prompts`` prompts of ``stdlib_complete_line`` greedily (``--max-tokens``
new tokens each, end-of-sequence ignored, so every configuration generates the same tokens) at
concurrency 1 (one request at a time) and 4 (four in the running batch), plainly and with each
drafting mode: prompt lookup (``ngram``) and every ``--draft`` model (default: the demo recipe's
most compressed published variant of ``small``, auto50-gptq4, where it exists; for ``moe-1g``,
``cpu_decode.py``'s 1.08 GB random Qwen3-MoE, its RTN-4 variant), each with the engine's
pacing (a sequence whose proposals stop paying pauses them) and with every sequence proposing
every step ("fixed"; ``--pacing``). Every k in ``--k`` is run; the table shows each mode's best
k with its acceptance rate, mean accepted length, verify count, tokens/s
(the requests' wall time, prompts included), the ratio to plain decoding measured in the same
run, and the mean target forward past the prompts (a decode step, or a verify chunk of 1 + k
tokens per sequence): on an MoE the chunk's tokens route to more experts than one token, so a
verify reads more weights than a step. Speculation also has to produce plain decoding's tokens;
a row says so.

With llama-cpp-python installed, the model is exported to GGUF (``--gguf-type``) and llama.cpp
decodes the same prompts at concurrency 1 with and without its prompt-lookup drafting
(``LlamaPromptLookupDecoding``), each in a subprocess: llama.cpp's decode crashes on this
machine for some GGUF types (docs/gguf.md), and a crash is reported as such.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from thresher.evaluate.builtin_tasks import prepare_builtin_tasks
from thresher.models import load_tokenizer, resolve_model
from thresher.paths import state_dir
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.speculative import SpeculativeConfig, SpeculativeStats

TASK = "stdlib_complete_line"
DEFAULT_DRAFT = "published/demo/auto50-gptq4"  # under the state directory


def prompts(n: int) -> list[str]:
    lines = (prepare_builtin_tasks() / f"{TASK}.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["context"] for line in lines]


def run(llm: LLM, texts: list[str], params: SamplingParams, concurrency: int
        ) -> tuple[float, list[list[int]]]:
    """Wall seconds and tokens of decoding ``texts`` at ``concurrency`` (1: one at a time)."""
    start = time.perf_counter()
    if concurrency == 1:
        outs = [llm.generate(t, params)[0] for t in texts]
    else:
        outs = llm.generate(texts, params)
    return time.perf_counter() - start, [list(o.token_ids) for o in outs]


def moe_1g(root: Path) -> Path:
    """The 1.08 GB random bf16 Qwen3-MoE of ``cpu_decode.py`` (10 layers, hidden 1024, 8 experts
    of width 2048, top-2), built under ``root`` once and reused."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scale"))
    from quant_scale import build_checkpoint

    out = root / "moe-1g"
    if not (out / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        build_checkpoint(out, layers=10, hidden=1024, experts=8, inter=2048, top_k=2)
    return out


def moe_1g_draft(model: Path) -> Path:
    """Its 4-bit draft (RTN, groups of 128: cpu_decode.py's GPTQ-4 row), built once beside it."""
    out = model.parent / "moe-1g-rtn4"
    if not (out / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "thresher", "quantize", "--model", str(model),
                        "--out", str(out), "--method", "rtn", "--bits", "4", "--group-size",
                        "128"], check=True, capture_output=True)
    return out


def measure(model: str, texts: list[str], params: SamplingParams, concurrency: int,
            speculative: SpeculativeConfig | None, dtype: str = "auto") -> dict:
    llm = LLM(model, max_num_seqs=concurrency, speculative=speculative, dtype=dtype)
    llm.generate(texts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    llm.engine.spec_stats = SpeculativeStats()  # count the measured run only
    forward = time_decode_forwards(llm)
    wall, tokens = run(llm, texts, params, concurrency)
    spec = llm.engine.spec_stats
    return {"tok_s": sum(map(len, tokens)) / wall, "tokens": tokens,
            "acceptance": spec.acceptance_rate, "mean_len": spec.mean_accepted_length,
            "draft_s": spec.draft_seconds, "verify_s": spec.verify_seconds, "wall": wall,
            "verifies": spec.num_drafts,
            "forward_ms": 1e3 * sum(forward) / max(len(forward), 1)}


def time_decode_forwards(llm: LLM) -> list[float]:
    """Seconds of each target forward past the prompts (a decode step, or a verify chunk of 1 + k
    tokens per sequence), appended as the engine runs: what a verify costs against a step."""
    runner, times = llm.engine.runner, []
    run_batch = runner.run

    def timed(batch):
        start = time.perf_counter()
        out = run_batch(batch)
        if all(s.num_computed_tokens >= s.num_prompt_tokens for s in batch.seqs):
            times.append(time.perf_counter() - start)
        return out

    runner.run = timed
    return times


def llama_worker(gguf: str, k: int, texts_file: str, max_tokens: int, threads: int) -> None:
    """Run in a subprocess: llama.cpp's greedy decode of every prompt, prompt lookup if k > 0;
    prints one JSON line."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    token_lists = json.loads(Path(texts_file).read_text())
    draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
    llm = Llama(gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False,
                draft_model=draft)
    generated, wall = 0, 0.0
    for ids in token_lists:
        llm.reset()
        start = time.perf_counter()
        out = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0)
        wall += time.perf_counter() - start
        generated += out["usage"]["completion_tokens"]
    print(json.dumps({"tok_s": generated / wall, "tokens": generated}))


def llama_rows(model: Path, token_lists: list[list[int]], args) -> list[tuple[str, str]]:
    """(label, result) rows for llama.cpp plain and with prompt lookup at each k."""
    from thresher.export import export_gguf

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / f"model-{args.gguf_type}.gguf"
        export_gguf(model, gguf, args.gguf_type, show_progress=False)
        texts_file = Path(tmp) / "prompts.json"
        texts_file.write_text(json.dumps(token_lists))
        base = None
        for k in [0, *args.k]:
            proc = subprocess.run(
                [sys.executable, __file__, "--llama-worker", str(gguf), str(k), str(texts_file),
                 "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)],
                capture_output=True, text=True, timeout=1800)
            label = f"llama.cpp {args.gguf_type}, " + (f"prompt lookup k={k}" if k else "plain")
            if proc.returncode != 0:
                rows.append((label, f"crashed (exit {proc.returncode}): "
                                    f"{proc.stderr.strip().splitlines()[-1:] or ''}"))
                continue
            tok_s = json.loads(proc.stdout.strip().splitlines()[-1])["tok_s"]
            base = base or tok_s
            rows.append((label, f"{tok_s:.1f} tok/s, {tok_s / base:.2f}x llama.cpp plain"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo:small",
                        help="a model directory, demo:<size>, or moe-1g: cpu_decode.py's 1.08 GB "
                             "random Qwen3-MoE (built under --workdir)")
    parser.add_argument("--workdir", type=Path, default=state_dir() / "bench",
                        help="where moe-1g is built and kept")
    parser.add_argument("--dtype", default="auto", help="the engine's serving dtype")
    parser.add_argument("--draft", action="append", default=None,
                        help="a draft model (repeatable); default: the published auto50-gptq4 "
                             "(moe-1g: its RTN-4 variant)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf-type", default="f16")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--pacing", choices=["both", "adaptive", "fixed"], default="both",
                        help="each drafting mode with its proposals paused where they stop paying "
                             "(the engine's default), with every sequence proposing every step "
                             "(fixed), or both in the same run")
    parser.add_argument("--llama-worker", nargs=3, metavar=("GGUF", "K", "PROMPTS"))
    args = parser.parse_args()
    if args.llama_worker:
        gguf, k, texts_file = args.llama_worker
        llama_worker(gguf, int(k), texts_file, args.max_tokens, args.threads)
        return
    torch.set_num_threads(args.threads)
    model = moe_1g(args.workdir) if args.model == "moe-1g" else resolve_model(args.model)
    drafts = args.draft
    if drafts is None and args.model == "moe-1g":
        drafts = [str(moe_1g_draft(model))]
    if drafts is None:
        default = state_dir() / DEFAULT_DRAFT
        drafts = [str(default)] if (default / "config.json").is_file() else []
    texts = prompts(args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"machine: {platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}; {args.model} ({args.dtype}); {TASK}: {len(texts)} prompts, "
          f"{args.max_tokens} new tokens each; k in {args.k}\n")
    print("| c | drafting | best k | acceptance | mean accepted length | verifies | tok/s | "
          "vs plain | draft s | verify s | target forward ms | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    pacings = [True, False] if args.pacing == "both" else [args.pacing == "adaptive"]
    for c in args.concurrency:
        plain = measure(str(model), texts, params, c, None, args.dtype)
        print(f"| {c} | none (plain) | - | - | - | - | {plain['tok_s']:.1f} | 1.00x | - | - | "
              f"{plain['forward_ms']:.2f} | - |", flush=True)
        for mode, adaptive in ((m, a) for m in ["ngram", *drafts] for a in pacings):
            runs = {k: measure(str(model), texts, params, c,
                               SpeculativeConfig(mode, k, adaptive=adaptive), args.dtype)
                    for k in args.k}
            k, best = max(runs.items(), key=lambda kv: kv[1]["tok_s"])
            same = all(r["tokens"] == plain["tokens"] for r in runs.values())
            name = "prompt lookup" if mode == "ngram" else f"draft {Path(mode).name}"
            name += "" if adaptive else ", fixed"
            print(f"| {c} | {name} | {k} | {best['acceptance']:.2f} | {best['mean_len']:.2f} | "
                  f"{best['verifies']} | {best['tok_s']:.1f} | "
                  f"{best['tok_s'] / plain['tok_s']:.2f}x | "
                  f"{best['draft_s']:.2f} | {best['verify_s']:.2f} | {best['forward_ms']:.2f} | "
                  f"{same} |", flush=True)
    if args.no_llama:
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("\nllama-cpp-python is not installed: llama.cpp's prompt lookup not measured")
        return
    tokenizer = load_tokenizer(model)
    token_lists = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    print("\n| llama.cpp (c=1) | result |\n|---|---|")
    for label, result in llama_rows(model, token_lists, args):
        print(f"| {label} | {result} |", flush=True)


if __name__ == "__main__":
    main()
