"""CPU greedy decode speed of one random MoE: 16-bit, 4-bit artifacts and llama.cpp.

A memory-bound random MoE (Qwen3-MoE by default) in 16 bits, its 4-bit artifacts, and the same
weights in llama.cpp, side by side in one run.

    PYTHONPATH=. python benchmarks/engine/cpu_decode.py --threads 2 --formats gptq4 awq4 nf4 \
        --dtypes float32 bfloat16                      # the whole table: 10 layers, ~1.1 GB bf16
    PYTHONPATH=. python benchmarks/engine/cpu_decode.py --layers 2 --threads 2   # small, loaded machine
    PYTHONPATH=. python benchmarks/engine/cpu_decode.py --family deepseek_v3 --threads 2 \
        --experts 32 --intermediate 512 --top-k 4 --formats gptq4 --dtypes bfloat16 \
        --quant-dtypes bfloat16 --gguf-types f16 q4_0 --concurrency 1   # DeepSeek-V3 shape, ~1.1 GB
    PYTHONPATH=. python benchmarks/engine/cpu_decode.py --family gpt_oss --threads 2 \
        --experts 32 --intermediate 512 --top-k 4 --formats gptq4 --dtypes bfloat16 \
        --quant-dtypes bfloat16 --gguf-types f16 q4_0 --concurrency 1   # gpt-oss shape, ~1.1 GB

Run it from the repository root with ``PYTHONPATH=.`` when the editable install points at
another checkout.

Builds the checkpoint of ``quant_scale`` (hidden 1024, 8 experts of 2048, top-2; with
``--family deepseek_v3`` its DeepSeek-V3-shaped one, exported to llama.cpp's ``deepseek2``; with
``--family gpt_oss`` or ``qwen3_5_moe`` one of those shapes) on disk,
quantizes it with thresher (RTN: GPTQ's format without the calibration time; AWQ with a few
calibration samples; NF4 through bitsandbytes), and times greedy decode through the engine for
each variant at each concurrency: decode tokens per second = new tokens / (time of N+1 tokens -
time of 1 token), so prefill is left out. The same bf16 checkpoint is exported with thresher's
GGUF exporter (``--gguf-types``, default f16 q8_0 q4_0) and decoded greedily by llama.cpp
(llama-cpp-python, ``make llama``) with the same thread count, prompt excluded; at batch 1 only
(llama-cpp-python's ``Llama`` decodes one sequence; its c=16 cells are left empty). Without
llama-cpp-python those rows are skipped with a message.

``--contexts`` sets the prompt lengths: every concurrency at the first, c=1 at the others (the
same prompt pattern repeated), for the engine and llama.cpp alike. Engine rows run the one-call C
decode step (``modeling/native_step.py``) where it applies; ``--steps native ops`` adds each
variant on the operator path (``THRESHER_CPU_STEP=off``) for comparison in the same run;
``--dense-max 0 131072 ...`` loads each 4-bit variant once per small-matrix threshold
(``THRESHER_CPU_DENSE_MAX``: matrices of at most that many weights dequantized at load). Host
ms / step (c=1, first context) = the decode steps' wall time minus the time inside the C step
and LM head calls (``NativeStep.seconds``; ``CausalLM.logits`` where the head stays on torch), the median
over decode steps of the best round: the scheduling, metadata, sampling and Python around the
native call; "-" on the operator path, whose host and kernel time interleave.

Bandwidth use = weight bytes one decode step reads per sequence (attention, router, top-k of the
experts, lm_head; the packed bytes a 4-bit layer's kernel reads; for GGUF the tensor bytes with
expert tensors scaled by top-k / experts, the embedding table left out) x tokens/s at
concurrency 1, against a 512 MB copy (read + write bytes; ``--copy-mb``) timed before and after
the runs (the faster of the two). A model small enough for the last-level cache, held against a
copy of its own size, stands in for a machine whose memory is that fast: there a step's fixed
costs weigh as they would on one. Prints one table
and the ratios against llama.cpp and the copy bandwidth; the files are deleted at the end unless --keep or --workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scale"))
from quant_scale import (  # the scale group's builders
    build_checkpoint,
    build_deepseek_v3_checkpoint,
    build_gpt_oss_checkpoint,
    build_qwen3_5_checkpoint,
)

from thresher.export import export_gguf
from thresher.export.llama_runtime import INSTALL_HINT, LLAMA_CPP_AVAILABLE, LlamaCppModel
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.kernels import cpu_dense, cpu_native, cpu_q4
from thresher.serve_kernels.modeling import native_step
from thresher.serve_kernels.modeling.gpt_oss import GptOssMoE
from thresher.serve_kernels.modeling.linear import DenseLinear
from thresher.serve_kernels.modeling.mla import LatentAttention
from thresher.serve_kernels.modeling.moe import ExpertLoop, FusedExperts

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 400, 12, 3, 250, 61, 8, 99, 150, 31]
QUANTIZE = {
    "gptq4": ["--method", "rtn", "--bits", "4", "--group-size", "128"],
    "awq4": ["--method", "awq", "--bits", "4", "--group-size", "128", "--samples", "4",
             "--seq-len", "64"],
    "nf4": ["--method", "nf4"],  # bitsandbytes' CPU NF4 kernel where the CPU has AVX512-BF16
    "gptq8": ["--method", "rtn", "--bits", "8", "--group-size", "128"],
}
NAMES = {"gptq4": "GPTQ-4 (RTN g128)", "awq4": "AWQ-4 g128", "nf4": "NF4",
         "gptq8": "GPTQ-8 (RTN g128)"}
# --family: the checkpoint builder (same arguments: --layers counts the MoE layers)
BUILDERS = {"qwen3_moe": build_checkpoint, "deepseek_v3": build_deepseek_v3_checkpoint,
            "gpt_oss": build_gpt_oss_checkpoint, "qwen3_5_moe": build_qwen3_5_checkpoint}


def long_enough(model_dir: Path, positions: int) -> None:
    """Raise a random model's ``max_position_embeddings`` to ``positions`` in its config.json
    (the checkpoint builder's 512 is shorter than ``--contexts`` may ask; rotary angles are
    computed from it at load, so no weight changes)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if config.get("max_position_embeddings", 0) < positions:
        config["max_position_embeddings"] = positions
        path.write_text(json.dumps(config, indent=2))


def copy_bandwidth(mb: int = 512) -> float:
    """Bytes per second a large tensor copy moves (read + write), best of five."""
    src = torch.ones(mb << 18)  # fp32: mb MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def bytes_per_token(llm: LLM) -> int | None:
    """Weight bytes one decode step reads for one sequence (see the module docstring); None when
    a layer runs a dequantizing reference, whose traffic is not its weight bytes."""
    model = llm.engine.runner.model
    top_k = next(layer.mlp.top_k for layer in model.layers if hasattr(layer.mlp, "top_k"))
    return module_bytes(model, top_k, native=bool(model.native_step))


def module_bytes(module: torch.nn.Module, top_k: int, native: bool = False) -> int | None:
    """Bytes the linears under ``module`` read per token, top_k of each layer's experts; with
    ``native`` (the C step) NF4 weights read their codes and a bf16 absmax per block."""
    dense = getattr(module, "cpu_dense", None)  # small matrices dequantized at load
    if isinstance(dense, tuple):  # experts: [E, N, K] gate|up and down
        return sum(t[0].numel() * t.element_size() for t in dense) * top_k
    if dense is not None:
        return dense.numel() * dense.element_size()
    if isinstance(module, FusedExperts):
        if module.format != "dense" and not module.cpu_packs:
            return None
        full = (sum(p.nbytes for p in module.cpu_packs) if module.cpu_packs else
                sum(b.numel() * b.element_size() for b in module.buffers()))
        experts = len(module.cpu_gate_up) if module.cpu_gate_up else \
            module.gate_up_weight.shape[0]
        return full * top_k // experts
    if isinstance(module, ExpertLoop) and module.cpu_packs:
        return sum(p.nbytes for p in module.cpu_packs) * top_k // len(module.gate)
    if isinstance(module, ExpertLoop | GptOssMoE):
        full = [module_bytes(m, top_k, native) for m in (*module.gate, *module.up, *module.down)]
        router = module_bytes(module.router, top_k, native) if isinstance(module, GptOssMoE) else 0
        return None if None in (*full, router) else sum(full) * top_k // len(module.gate) + router
    if isinstance(module, DenseLinear):
        w = module.cpu_blocked.weight if module.cpu_blocked is not None else module.weight
        return w.numel() * w.element_size()
    if getattr(module, "cpu_packs", None):
        return sum(p.nbytes for p in module.cpu_packs)
    if native and hasattr(module, "nf4"):  # cpu_nf4.c on the published codes
        codes = module.nf4.packed.numel()
        return codes + 2 * (2 * codes // module.nf4.blocksize)
    if hasattr(module, "qweight") or hasattr(module, "nf4"):
        return None
    parts = [module_bytes(m, top_k, native) for m in module.children()]
    if isinstance(module, LatentAttention):  # kv_b, absorbed per head: dense buffers
        parts.append(module.w_kb.nbytes + module.w_vb.nbytes)
    return None if None in parts else sum(parts)


def gguf_bytes_per_token(path: Path, experts: int, top_k: int) -> int:
    """Tensor bytes a llama.cpp decode step reads per token: every tensor but the embedding
    table (one row of it), the expert tensors scaled by top_k / experts."""
    import gguf

    total = 0
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("token_embd"):
            continue
        n = int(t.n_bytes)
        total += n * top_k // experts if "_exps" in t.name else n
    return total


def prompt_of(context: int, shift: int = 0) -> list[int]:
    """A prompt of ``context`` tokens: PROMPT's pattern repeated, shifted per sequence."""
    return [(PROMPT[i % len(PROMPT)] + 7 * (i // len(PROMPT)) + shift) % 4000
            for i in range(context)]


def columns(concurrency: list[int], contexts: list[int]) -> list[tuple[int, int]]:
    """(concurrency, context) cells: every concurrency at the first context, c=1 at the rest."""
    return [(c, contexts[0]) for c in concurrency] + [(1, n) for n in contexts[1:]]


def llama_rate_sample(llm: LlamaCppModel, tokens: int, context: int) -> float:
    """One llama.cpp greedy decode at batch 1: tokens per second, prompt excluded."""
    return llm.greedy(prompt_of(context), tokens)[1].tokens_per_second


class StepClock:
    """Per engine step: wall time, and the time inside the C step and the LM head (see the
    module docstring); wraps ``engine.step`` and ``CausalLM.logits``."""

    def __init__(self, llm: LLM):
        engine, model = llm.engine, llm.engine.runner.model
        self.kernel = 0.0  # LM head seconds so far (the C step keeps its own)
        self.host: list[float] = []  # per decode step, host seconds
        logits, step = model.logits, engine.step

        def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
            native = model.native_step
            inside, start = native.seconds if native else 0.0, time.perf_counter()
            out = logits(hidden)  # the C LM head counts in native.seconds already
            self.kernel += time.perf_counter() - start - (
                native.seconds - inside if native else 0.0)
            return out

        def timed_step():
            native = model.native_step
            calls, inside = (native.calls, native.seconds) if native else (0, 0.0)
            kernel, start = self.kernel, time.perf_counter()
            out = step()
            wall = time.perf_counter() - start
            if native and native.calls == calls + 1:  # a decode step on the C path
                self.host.append(wall - (native.seconds - inside) - (self.kernel - kernel))
            return out

        model.logits, engine.step = timed_logits, timed_step

    def take(self) -> list[float]:
        """The host seconds of the decode steps since the last call."""
        host, self.host = self.host, []
        return host


def engine_times(llm: LLM, clock: StepClock, concurrency: int, context: int, new_tokens: int
                 ) -> tuple[float, float, float | None]:
    """Seconds to generate 1 and ``new_tokens + 1`` tokens for ``concurrency`` sequences (their
    difference is the decode time with prefill left out), and the median host seconds of the
    decode steps (None on the operator path)."""
    prompts = [prompt_of(context, i) for i in range(concurrency)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    clock.take()
    first, full = run(1), run(new_tokens + 1)
    host = clock.take()
    return first, full, statistics.median(host) if host else None


def measure(engines: dict[str, LLM], llamas: dict[str, LlamaCppModel], cells: list[tuple[int, int]],
            tokens: int, repeats: int) -> tuple[dict[str, list[float | None]], dict[str, float]]:
    """Decode tokens per second of every variant in every (concurrency, context) cell
    (llama.cpp: batch 1), and each engine's host seconds per step in the first cell at c=1.

    The variants take turns, one timed run each per round, for ``repeats`` rounds, so a busy
    spell of a shared machine falls on all of them; each reports its best round (for the
    engine, the fastest 1-token and N+1-token runs)."""
    times: dict[tuple[str, tuple[int, int]], list[tuple[float, float, float | None]]] = {}
    llama_rates: dict[tuple[str, int], list[float]] = {}
    clocks = {name: StepClock(llm) for name, llm in engines.items()}
    for name, llm in engines.items():  # warm up
        for c, n in cells:
            engine_times(llm, clocks[name], c, n, 2)
    for llm in llamas.values():
        llm.greedy(PROMPT, 4)
    for _ in range(repeats):
        for name, llm in engines.items():
            for cell in cells:
                times.setdefault((name, cell), []).append(
                    engine_times(llm, clocks[name], *cell, tokens))
        for name, llm in llamas.items():
            for c, n in cells:
                if c == 1:
                    llama_rates.setdefault((name, n), []).append(
                        llama_rate_sample(llm, tokens, n))
    rates: dict[str, list[float | None]] = {}
    host: dict[str, float] = {}
    for name in engines:
        rates[name] = []
        for cell in cells:
            first, full, hosts = zip(*times[(name, cell)], strict=True)
            rates[name].append(cell[0] * tokens / (min(full) - min(first)))
            if cell == (1, cells[0][1]) and None not in hosts:
                host[name] = min(hosts)
    for name in llamas:
        rates[name] = [max(llama_rates[(name, n)]) if c == 1 else None for c, n in cells]
    return rates, host


def quantize(src: Path, out: Path, fmt: str) -> None:
    """``thresher quantize`` of the random model into ``out`` as ``fmt`` (QUANTIZE's options)."""
    cmd = [sys.executable, "-m", "thresher", "quantize", "--model", str(src), "--out", str(out),
           *QUANTIZE[fmt]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
        raise SystemExit(f"quantize {fmt} failed with exit status {proc.returncode}")


def gguf_exports(root: Path, src: Path, gguf_types: list[str]) -> list[tuple[str, Path]]:
    """(row name, file) of each GGUF export of ``src`` under ``root``, written where missing;
    none, with the install hint, where llama-cpp-python is not installed."""
    if gguf_types and not LLAMA_CPP_AVAILABLE:
        print(f"llama.cpp rows skipped: {INSTALL_HINT}")
        return []
    ggufs = []
    for gguf_type in gguf_types:
        out = root / f"model-{gguf_type}.gguf"
        if not out.is_file():
            export_gguf(src, out, gguf_type, show_progress=False)
        ggufs.append((f"llama.cpp {gguf_type.upper()}", out))
    return ggufs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=list(BUILDERS), default="qwen3_moe",
                    help="deepseek_v3: latent attention, a dense first layer, a shared expert, "
                         "a sigmoid router over 4 groups (2 kept); gpt_oss: sinks, sliding and "
                         "full layers, biased experts with the clamped SwiGLU; qwen3_5_moe: "
                         "Gated DeltaNet and gated attention layers, a gated shared expert")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per run")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds; every variant is timed once per round, in turn, and its best "
                         "round is reported (both runtimes)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16],
                    help="prompt lengths: every concurrency at the first, c=1 at the others "
                         "(e.g. 16 256 1024)")
    ap.add_argument("--steps", nargs="+", default=["native"], choices=["native", "ops"],
                    help="engine decode steps: the one-call C step where it applies, and/or the "
                         "operator path (THRESHER_CPU_STEP=off)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="engine dtypes of the 16-bit model")
    ap.add_argument("--formats", nargs="+", default=["gptq4", "awq4", "nf4"],
                    choices=list(QUANTIZE))
    ap.add_argument("--quant-dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="engine dtypes of the 4-bit rows (their kernels compute in bf16 either "
                         "way; the activations between them are in this dtype)")
    ap.add_argument("--int4-kernels", nargs="+", default=["q4", "torch"],
                    choices=["q4", "torch"],
                    help="GPTQ-4/AWQ-4 rows per CPU kernel: thresher's cpu_q4 (int8 activations) "
                         "and torch's _weight_int4pack_mm_for_cpu (q4 rows are skipped where it "
                         "does not build)")
    ap.add_argument("--gguf-types", nargs="*", default=["f16", "q8_0", "q4_0"],
                    help="llama.cpp rows (thresher's GGUF export of the same weights); none (or no "
                         "value): no llama.cpp rows")
    ap.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="build here and keep; a model or artifact already there is reused")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch and llama.cpp threads (default: torch's)")
    ap.add_argument("--copy-mb", type=int, default=512,
                    help="MB copied to measure the bandwidth each row is held against: 512 "
                         "streams from memory; for a model that fits the last-level cache, its "
                         "4-bit size (the rate its weights arrive at from the cache)")
    ap.add_argument("--dense-max", type=int, nargs="+", default=None, metavar="WEIGHTS",
                    help="load each 4-bit variant once per value with THRESHER_CPU_DENSE_MAX set "
                         "to it (matrices of at most that many weights dequantized at load; 0: "
                         "every matrix packed); default: the engine's threshold, one row")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    args.gguf_types = [t for t in args.gguf_types if t != "none"]
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    root = args.workdir or Path(tempfile.mkdtemp(prefix="thresher-cpu-decode-", dir=args.dir))
    keep = args.keep or args.workdir is not None
    try:
        src = root / "model"
        if not (src / "config.json").is_file():
            BUILDERS[args.family](src, args.layers, args.hidden, args.experts,
                                  args.intermediate, args.top_k)
        long_enough(src, max(args.contexts) + args.tokens + 8)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        variants = [(f"engine 16-bit ({d})", src, d, None) for d in args.dtypes]
        for fmt in args.formats:
            out = root / fmt
            kernels = args.int4_kernels if fmt in ("gptq4", "awq4") else [None]
            if cpu_q4.library() is None:  # no compiler or AVX2 here, or THRESHER_CPU_NATIVE=off
                kernels = [k for k in kernels if k != "q4"] or ["torch"]
            variants += [(f"engine {NAMES[fmt]} {d}" + (f" {k}" if k else ""), out, d, k)
                         for d in args.quant_dtypes for k in kernels]
            if (out / "config.json").is_file():
                long_enough(out, max(args.contexts) + args.tokens + 8)
                continue
            quantize(src, out, fmt)
        variants = [(name + (" ops" if step == "ops" else ""), path, dtype, kernel, step, None)
                    for name, path, dtype, kernel in variants for step in args.steps]
        if args.dense_max is not None:
            variants = [v for v in variants if v[1] == src] + [
                (f"{name} dense<={limit}", path, dtype, kernel, step, limit)
                for name, path, dtype, kernel, step, _ in variants if path != src
                for limit in args.dense_max]
        ggufs = gguf_exports(root, src, args.gguf_types)
        bandwidth = copy_bandwidth(args.copy_mb)
        rows: dict[str, tuple[int | None, list[float | None], str, str]] = {}
        engines: dict[str, LLM] = {}
        setting = os.environ.get(cpu_native.ENV)
        cells = columns(args.concurrency, args.contexts)
        max_len = max(args.contexts) + args.tokens + 8
        for name, path, dtype, kernel, step, limit in variants:
            if kernel == "torch":  # packs read the setting at load time
                os.environ[cpu_native.ENV] = "off"
            if limit is not None:  # read at load time too
                os.environ[cpu_dense.ENV_VAR] = str(limit)
            if step == "ops":  # at load: no C step built, the blocked layout kept
                os.environ[native_step.ENV] = "off"
            try:
                engines[name] = LLM(path, dtype=dtype, max_num_seqs=max(args.concurrency),
                                    max_model_len=max_len)
            except Exception as exc:  # a dtype the engine cannot serve yet is reported, not fatal
                rows[name] = (None, [], "-", f"{type(exc).__name__}: {str(exc)[:60]}")
            finally:
                os.environ.pop(cpu_native.ENV, None)
                os.environ.pop(native_step.ENV, None)
                os.environ.pop(cpu_dense.ENV_VAR, None)
                if setting is not None:
                    os.environ[cpu_native.ENV] = setting
        max_tokens = max_len
        llamas = {name: LlamaCppModel(path, n_ctx=max_tokens, n_threads=threads)
                  for name, path in ggufs}
        try:
            rates, host = measure(engines, llamas, cells, args.tokens, args.repeats)
            # a busy spell may have hit the first
            bandwidth = max(bandwidth, copy_bandwidth(args.copy_mb))
        finally:
            for llm in llamas.values():
                llm.close()
        for name, llm in engines.items():
            per_token = bytes_per_token(llm)
            step = "C step" if llm.engine.runner.model.native_step else "operator path"
            ms = f"{host[name] * 1e3:.2f}" if name in host else "-"
            rows[name] = (per_token, rates[name], ms,
                          step if per_token else "dequantizing reference")
        for name, path in ggufs:
            rows[name] = (gguf_bytes_per_token(path, args.experts, args.top_k), rates[name], "-",
                          "batch 1 only")
        print_table(args, size, bandwidth, threads, rows, cells)
    finally:
        if keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def ratios(rows: list[str]) -> list[tuple[str, str]]:
    """(numerator row, denominator row): against llama.cpp, against the engine's bf16 row, and
    the C step against the operator path, among ``rows``."""
    bf16 = "engine 16-bit (bfloat16)"
    pairs = [(bf16, "llama.cpp F16"), ("engine 16-bit (float32)", bf16)]
    for row in rows:
        if row.startswith(("engine GPTQ-4", "engine AWQ-4")) and not row.endswith(" ops"):
            pairs.append((row, "llama.cpp Q4_0"))
    for row in rows:
        if row.startswith("engine") and "16-bit" not in row and not row.endswith(" ops"):
            pairs.append((row, bf16))
    pairs += [(row[:-4], row) for row in rows if row.endswith(" ops")]
    for row in rows:  # --dense-max: each threshold against every matrix packed
        head, sep, limit = row.rpartition(" dense<=")
        if sep and limit != "0":
            pairs.append((row, f"{head} dense<=0"))
    return pairs


def print_table(args: argparse.Namespace, size: int, bandwidth: float, threads: int,
                rows: dict[str, tuple[int | None, list[float | None], str, str]],
                cells: list[tuple[int, int]]) -> None:
    """The rates table, then each ratio whose two rows were measured."""
    print(f"\nrandom-init {args.family}, {args.layers} layers, hidden {args.hidden}, "
          f"{args.experts} experts x {args.intermediate} (top-{args.top_k}): {size / 1e9:.2f} GB "
          f"in bf16; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {threads} threads; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s ({args.copy_mb} MB); load average {os.getloadavg()[0]:.1f}\n")
    heads = [f"c={c} ctx {n} tok/s" for c, n in cells]
    print(f"| variant | MB read / token | {' | '.join(heads)} | bandwidth use (c=1) "
          "| host ms / step | note |")
    print("|---|---|" + "---|" * len(cells) + "---|---|---|")
    for name, (per_token, rates, host, note) in rows.items():
        text = " | ".join("-" if r is None else f"{r:.2f}" for r in rates) if rates else \
            " | ".join("-" for _ in cells)
        use = f"{per_token * rates[0] / bandwidth:.1%}" if rates and rates[0] and per_token else "-"
        mb = f"{per_token / 2**20:.0f}" if per_token else "-"
        print(f"| {name} | {mb} | {text} | {use} | {host} | {note} |")
    print(f"\n| ratio | {' | '.join(heads)} |")
    print("|---|" + "---|" * len(cells))
    for num, den in ratios(list(rows)):
        if not (rows.get(num, (0, []))[1] and rows.get(den, (0, []))[1]):
            continue
        text = [f"{a / b:.2f}x" if a and b else "-"
                for a, b in zip(rows[num][1], rows[den][1], strict=True)]
        print(f"| {num} / {den} | {' | '.join(text)} |")


if __name__ == "__main__":
    main()
