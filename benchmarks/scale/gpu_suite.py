"""The GPU suite: every GPU measurement the project's goals name, from one command.

All sections together take over 20 minutes of an H100, more than a session's device time (15
minutes, start-up included): name the sections to run (``--sections``) and bound them
(``--budget-s``).

    python benchmarks/scale/gpu_suite.py --prepare gpu_bundle --demos tiny --carry .gpucarry
                                                            # CPU machine: models, wheels, packed
    python3 benchmarks/scale/gpu_suite.py --carry .gpucarry --out OUT --budget-s 480
                                                            # GPU machine: every section
    python benchmarks/scale/gpu_suite.py --dry-run --out OUT  # CPU: every section at toy sizes

Sections, each a markdown table (printed, and written to OUT/gpu_suite.md; tracebacks and test
output to OUT/gpu_suite.log; a failing section reports its error and the next one runs):

1. tests: the kernel tests on CUDA tensors and the ``cuda``-marked engine tests (``cuda``, by
   name only: the engine tests alone, under a minute where the kernel tests take four).
2. gemv: W4A16 (grouped GPTQ, AWQ; the act-order GPTQ kernel beside them) and NF4 at M=1 for
   K, N in {4096, 8192, 14336}, against the device copy bandwidth measured first (bytes read +
   written). Weights rotate through > 256 MiB of copies, so L2 does not serve them; the calls
   are captured in a CUDA graph and timed with CUDA events (``device_seconds``), so launch
   latency is not counted; the tile each shape chose (``kernels/tuning.py``) is printed.
2b. moe kernel: the fused GPTQ-4 MoE kernel at decode shapes (M = 1..64 tokens, top-8 of 128
   experts), the bytes of the distinct experts routed to per second against the copy bandwidth,
   with one row of zeros and scales per K tile (contiguous groups) and with the g_idx gather.
3. decode: tokens/s at concurrency 1 on a random 16-layer Qwen3-MoE of >= 4 GB in bf16 against
   its roofline (copy bandwidth / bytes one token reads: attention weights, the router, top-k
   experts of each layer, the KV cache), with the step's wall time beside its GPU busy time.
4. vs_hf: the engine against transformers' ``generate`` (bf16, same prompts, greedy, same new
   tokens) at concurrency 1, 16 and 64 on that model.
5. parity: greedy tokens of the engine against transformers on the device, in float32 and in
   bfloat16, for the demo models and their GPTQ/AWQ/NF4 artifacts from the bundle (transformers
   runs the dequantized weights), and random GLM-4.5, DeepSeek-V3, ERNIE-4.5 and gpt-oss
   checkpoints with their GPTQ-4 artifacts; at each divergence, the rank and logit gap of the
   engine's token in transformers' logits (near ties part bf16 implementations; defects show as
   a high rank or a large gap). ``--parity-models`` names the ones to run (about 45 s each per
   dtype on an H100).
7. quantized decode: the same model in the GPTQ-4 layout (RTN codes: GPTQ's bytes and kernels,
   in seconds), AWQ-4 and NF4, decode at concurrency 1 against the roofline of the bytes a token
   reads in each format; beside it, the prefill and decode steps of a fresh engine's first two
   requests and the shapes tuned in each (what is done once per shape shows where it is paid).
6. gptq: GPTQ-4 of the random MoE's first layer with ``thresher quantize --device cuda``, then
   ``--device cpu`` limited to 2 threads like the 2-core machine and again with every core:
   seconds per decoder layer from each report, and the CPU / GPU ratio. The dry run runs all
   three on the CPU at toy sizes.
8. prune: REAP-50% with the refit of that layer with ``thresher prune --device cuda``, then
   ``--device cpu`` with 2 threads: seconds, peak device memory, and the kept experts the two
   runs share.

Sections run in the order above (``--sections`` picks and orders them); ``--budget-s`` skips
those that would start after it, so a run under a device's time limit ends with its tables.

``--dry-run`` runs the same code at toy sizes on the CPU (Triton kernels through the
interpreter), to prove the suite end to end before GPU minutes are spent.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

DRY = "--dry-run" in sys.argv
if DRY:  # before triton is imported: kernels on CPU tensors run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # thresher is imported inside the sections: on the GPU
# machine its dependencies (pydantic...) arrive with the carry that main() installs first

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DEMO_QUANT = {"gptq4": ["--method", "gptq", "--bits", "4", "--group-size", "32"],  # tiny's experts
              "awq4": ["--method", "awq", "--bits", "4", "--group-size", "32"],  # have 64 inputs
              "nf4": ["--method", "nf4"]}


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between a GPU run and a dry run."""

    gemv_shapes: tuple[int, ...]
    kernel_experts: int  # E of the fused-MoE kernel section (the decode model has fewer)
    rotate_bytes: int
    copy_bytes: int
    moe: dict
    concurrency: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    gptq_samples: int


# The decode model: Qwen3-30B-A3B's layer shapes and active bytes per token and layer (hidden 2048,
# experts of 768, top-8, 32 query / 4 KV heads), 32 experts instead of 128 so that 16 layers fit
# 5.4 GB: deep enough that the 1.8 GB a token reads outlasts the step's host work.
GPU = Sizes((4096, 8192, 14336), 128, 256 << 20, 1 << 30,
            dict(hidden=2048, layers=16, experts=32, inter=768, top_k=8, heads=32, kv=4, hd=128),
            (1, 16, 64), 64, 64, 32)
TOY = Sizes((256,), 4, 1 << 20, 8 << 20,
            dict(hidden=64, layers=2, experts=4, inter=32, top_k=2, heads=4, kv=2, hd=16),
            (1, 4), 8, 4, 2)


# ---------------------------------------------------------------- child processes

def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child run from the source tree: the repository first on PYTHONPATH,
    the caller's entries (carried wheels) kept after it."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_logged(cmd: list[str], log: Path, timeout: float | None = None,
               **env: str) -> tuple[int, str]:
    """Run ``cmd`` with its output appended to ``log`` as it comes (a run stopped at the device's
    time limit still shows how far it got): the exit status (124 on ``timeout``) and the output's
    last 2,000 characters."""
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        start = f.tell()
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  env=child_env(**env), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
        f.write("\n")
    with log.open("rb") as f:
        f.seek(max(start, f.seek(0, 2) - 2000))
        return code, f.read().decode(errors="replace")


def run_checked(cmd: list[str], log: Path, timeout: float | None = None, **env: str) -> None:
    code, tail = run_logged(cmd, log, timeout, **env)
    if code:
        raise RuntimeError(f"{' '.join(cmd[2:5])} exited {code}: {tail[-500:]}")


# ---------------------------------------------------------------- timing helpers

def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], iters: int) -> float:
    """Median wall time of ``fn`` over ``iters`` calls after two warm-ups (device synced)."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def device_seconds(calls: list[Callable[[], object]], repeats: int = 5) -> tuple[float, str]:
    """Median seconds per call of ``calls`` run back to back, and how they were timed.

    On CUDA the calls are captured once in a CUDA graph and the replay is timed with CUDA events,
    so neither Python nor launch latency is counted: a 4-bit GEMV at K = N = 4096 reads 8 MiB,
    ~3 us at H100 bandwidth, less than one launch. A capture that fails (a kernel that
    synchronises) falls back to events around the eager loop. In a dry run: wall time.
    """
    if not torch.cuda.is_available():
        return median_seconds(lambda: [c() for c in calls], repeats) / len(calls), "wall"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream: kernels compile here
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        run, how = graph.replay, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        run, how = (lambda: [c() for c in calls]), "events"
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2] / len(calls), how


_BANDWIDTH: dict[int, float] = {}


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read + written), measured once a run."""
    if nbytes not in _BANDWIDTH:
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device())
        dst = torch.empty_like(src)
        _BANDWIDTH[nbytes] = 2 * nbytes / device_seconds([lambda: dst.copy_(src)] * 4)[0]
    return _BANDWIDTH[nbytes]


# ---------------------------------------------------------------- section 1: tests

def section_tests(sizes: Sizes, log: Path, timeout: float | None = None,
                  kernels: bool = True) -> str:
    """The ``cuda`` engine tests, and with ``kernels`` every kernel test on CUDA tensors (about 4
    minutes of Triton compiles on 16 workers)."""
    files = ["tests/serve_kernels/test_cuda.py"]
    if kernels and not DRY:
        files.append("tests/serve_kernels/kernels")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if DRY:
        cmd += ["-m", "cuda"]
    elif importlib.util.find_spec("xdist") is not None:  # Triton compiles dominate: spread them
        cmd += ["-n", str(min(16, os.cpu_count() or 1))]
    start = time.perf_counter()
    code, tail = run_logged(cmd, log, timeout)
    lines = tail.strip().splitlines()
    summary = lines[-1] if lines else ""
    return ("| tests | exit status | summary | s |\n|---|---|---|---|\n"
            f"| {' '.join(files)} {'-m cuda' if DRY else ''} | {code} | {summary} | "
            f"{time.perf_counter() - start:.0f} |")


# ---------------------------------------------------------------- section 2: GEMV bandwidth

def _random_gptq(k: int, n: int, group: int, dev, gen) -> tuple:
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), generator=gen,
                           dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.01).to(torch.bfloat16)
    return tuple(t.to(dev) for t in (qweight, qzeros, scales))


def _random_nf4(k: int, n: int, dev, gen):
    from thresher.formats.nf4 import NF4Weight

    packed = torch.randint(0, 256, (k * n // 2, 1), generator=gen, dtype=torch.uint8)
    absmax = torch.rand(k * n // 64, generator=gen)
    return NF4Weight(packed.to(dev), absmax.to(dev), torch.linspace(-1, 1, 16).to(dev), (n, k),
                     dtype=torch.bfloat16)


def section_gemv(sizes: Sizes, log: Path) -> str:
    bw = copy_bandwidth(sizes.copy_bytes)
    rows = [f"device copy bandwidth (read + write): {bw / 1e9:.0f} GB/s\n",
            "| kernel | K | N | us | GB/s | % of copy | timed by | config |",
            "|---|---|---|---|---|---|---|---|"]
    for k in sizes.gemv_shapes:
        for n in sizes.gemv_shapes:
            for name, sec, how, nbytes, config in _gemv_times(k, n, sizes):
                rate = nbytes / sec
                rows.append(f"| {name} | {k} | {n} | {sec * 1e6:.1f} | {rate / 1e9:.0f} | "
                            f"{rate / bw:.0%} | {how} | {config} |")
            gc.collect()
    return "\n".join(rows)


def _gemv_times(k: int, n: int, sizes: Sizes) -> list[tuple[str, float, str, int, str]]:
    """(kernel, median seconds, how timed, bytes moved, launch config) of each 4-bit GEMV at
    one shape, each call on the next copy of the weights (> L2 in all)."""
    from thresher.serve_kernels.kernels import w4a16
    from thresher.serve_kernels.kernels.nf4 import nf4_matmul_triton

    dev, gen = device(), torch.Generator().manual_seed(k + n)
    group = 128 if not DRY else 32
    x = torch.randn(1, k, device=dev).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    q, z, s = _random_gptq(k, n, group, dev, gen)
    weight_bytes = q.nbytes + z.nbytes + s.nbytes
    copies = max(1, sizes.rotate_bytes // weight_bytes)
    gptq = [(q, z, s)] + [tuple(t.clone() for t in (q, z, s)) for _ in range(copies - 1)]
    g_idx = torch.arange(k, device=dev, dtype=torch.int32) // group
    awq_q = torch.randint(-2**31, 2**31 - 1, (k, n // 8), generator=gen,
                          dtype=torch.int32).to(dev)  # the same bytes as GPTQ's qweight
    awq = [(awq_q, z, s)] + [tuple(t.clone() for t in (awq_q, z, s)) for _ in range(copies - 1)]
    nf4 = [_random_nf4(k, n, dev, gen)]
    nf4_bytes = nf4[0].packed.nbytes + nf4[0].absmax.nbytes
    nf4 += [_random_nf4(k, n, dev, gen) for _ in range(max(0, sizes.rotate_bytes // nf4_bytes - 1))]
    io = x.nbytes + n * 4  # activations in, fp32 split-K output
    cases = {
        f"gptq-4 g{group} grouped": (weight_bytes, lambda i: w4a16.gptq_matmul_triton(
            x, *gptq[i % len(gptq)], g_idx, group_size=group)),
        f"gptq-4 g{group} act-order kernel": (weight_bytes + g_idx.nbytes,
                                         lambda i: w4a16.gptq_matmul_triton(
                                             x, *gptq[i % len(gptq)], g_idx)),
        f"awq-4 g{group} grouped": (weight_bytes, lambda i: w4a16.awq_matmul_triton(
            x, *awq[i % len(awq)], group)),
        "nf4 (fp32 absmax)": (nf4_bytes, lambda i: nf4_matmul_triton(x, nf4[i % len(nf4)])),
    }
    from thresher.serve_kernels.kernels import tuning

    out = []
    calls = 4 if DRY else 64
    for name, (nbytes, fn) in cases.items():
        before = tile_choices()
        sec, how = device_seconds([lambda fn=fn, i=i: fn(i) for i in range(calls)])
        new = [tuning.describe(cfg) for key, cfg in tile_choices().items() if key not in before]
        out.append((name, sec, how, nbytes + io, ", ".join(new) or "default"))
    return out


def tile_choices() -> dict[tuple, object]:
    """Every tile ``tuning`` has chosen so far, by (kernel, shape key)."""
    from thresher.serve_kernels.kernels import tuning

    return {(kernel, key): cfg for kernel, keys in tuning.chosen().items()
            for key, cfg in keys.items()}


def section_moe_kernel(sizes: Sizes, log: Path) -> str:
    """The fused W4A16 MoE kernel at decode shapes (M tokens, top-k experts of E, GPTQ-4), where a
    quantized MoE spends its decode time: bytes it must read (the distinct experts the M tokens
    route to) per second, against the copy bandwidth; with contiguous groups known (one row of
    zeros and scales per K tile, what the engine runs for GPTQ without act-order) and without
    (a gather through g_idx per weight, what act-order needs)."""
    from thresher.serve_kernels.kernels import tuning
    from thresher.serve_kernels.kernels.moe import DECODE, ExpertWeights, fused_moe_triton

    m = sizes.moe
    dev, gen = device(), torch.Generator().manual_seed(1)
    e, h, inter, top_k = sizes.kernel_experts, m["hidden"], m["inter"], m["top_k"]
    group = 128 if not DRY else 32
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def gptq_experts(k: int, n: int) -> ExpertWeights:
        q = torch.randint(-2**31, 2**31 - 1, (e, k // 8, n), generator=gen, dtype=torch.int32)
        z = torch.randint(-2**31, 2**31 - 1, (e, k // group, n // 8), generator=gen,
                          dtype=torch.int32)
        sc = (torch.rand(e, k // group, n, generator=gen) * 0.01).to(dtype)
        g_idx = (torch.arange(k) // group).expand(e, k).int()
        return ExpertWeights("gptq", q.to(dev), sc.to(dev), z.to(dev), g_idx.to(dev),
                             contiguous_group=group)

    w1, w2 = gptq_experts(h, 2 * inter), gptq_experts(inter, h)
    # the same weights with their groups unknown: the g_idx gather act-order needs
    kinds = [(w1, w2), tuple(dataclasses.replace(w, contiguous_group=None) for w in (w1, w2))]
    per_expert = sum(t[0].nbytes for w in (w1, w2) for t in (w.weight, w.scales, w.qzeros))
    bw = copy_bandwidth(sizes.copy_bytes)
    rows = [f"GPTQ-4 g{group} experts: E={e}, top-{top_k}, hidden {h}, intermediate {inter}; "
            f"{per_expert / 2**20:.2f} MiB per expert; copy {bw / 1e9:.0f} GB/s\n",
            "| tokens M | distinct experts (mean) | groups | us | GB/s | % of copy | timed by |",
            "|---|---|---|---|---|---|---|"]
    for tokens in ((1, 4) if DRY else (1, 2, 4, 8, 16, 32, 64)):
        x = torch.randn(tokens, h, generator=gen).to(dtype).to(dev)
        routes = []  # a different routing per call, so the calls do not share experts in L2
        for _ in range(4 if DRY else 32):
            ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
            routes.append((ids.to(dev), torch.softmax(torch.rand(tokens, top_k, generator=gen),
                                                      -1).to(dev)))
        distinct = sum(ids.unique().numel() for ids, _ in routes) / len(routes)
        for w1, w2 in kinds:
            sec, how = device_seconds([
                lambda x=x, ids=ids, w=w, w1=w1, w2=w2: fused_moe_triton(x, w1, w2, w, ids)
                for ids, w in routes])
            rate = distinct * per_expert / sec
            how_grouped = "rows" if w1.row_group(DECODE.block_k) else "g_idx"
            rows.append(f"| {tokens} | {distinct:.1f} | {how_grouped} | "
                        f"{sec * 1e6:.1f} | {rate / 1e9:.0f} | {rate / bw:.0%} | {how} |")
    chosen = tuning.chosen().get("_moe_matmul_kernel", {})
    rows.append("\ntiles chosen (pairs bucket, N, K, dtype, format, rows, block_m, block_k, "
                "weighted): " + "; ".join(f"{key}: {tuning.describe(c)}"
                                          for key, c in chosen.items()))
    return "\n".join(rows)


# ---------------------------------------------------------------- the random MoE

def build_random_moe(out: Path, tokenizer_dir: Path, m: dict) -> int:
    """A random bf16 Qwen3-MoE checkpoint (written one layer at a time); its size in bytes."""
    from thresher.models.checkpoint import CheckpointWriter
    from thresher.models.random_init import random_config

    h, e, inter, heads, kv, hd = m["hidden"], m["experts"], m["inter"], m["heads"], m["kv"], m["hd"]
    config = random_config("qwen3_moe", hidden_size=h, num_layers=m["layers"], num_experts=e,
                           top_k=m["top_k"], intermediate_size=inter, vocab_size=4096,
                           num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                           dtype="bfloat16")
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.max_position_embeddings = 2048
    out.mkdir(parents=True)
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    gen_dev = device()
    gen = torch.Generator(device=gen_dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=gen_dev) * 0.02).to(
            torch.bfloat16).cpu()

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    writer = CheckpointWriter(out, max_shard_bytes=2 << 30)
    writer.add({"model.embed_tokens.weight": rand(4096, h), "lm_head.weight": rand(4096, h),
                "model.norm.weight": ones(h)})
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        state = {p + "input_layernorm.weight": ones(h),
                 p + "post_attention_layernorm.weight": ones(h),
                 p + "self_attn.q_proj.weight": rand(heads * hd, h),
                 p + "self_attn.k_proj.weight": rand(kv * hd, h),
                 p + "self_attn.v_proj.weight": rand(kv * hd, h),
                 p + "self_attn.o_proj.weight": rand(h, heads * hd),
                 p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                 p + "mlp.gate.weight": rand(e, h) * 50}
        for j in range(e):
            state[p + f"mlp.experts.{j}.gate_proj.weight"] = rand(inter, h)
            state[p + f"mlp.experts.{j}.up_proj.weight"] = rand(inter, h)
            state[p + f"mlp.experts.{j}.down_proj.weight"] = rand(h, inter)
        writer.add(state)
    writer.close()
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def bytes_per_token(m: dict, context: int, weight_bits: float = 16) -> int:
    """Bytes one decode token reads: attention and top-k expert weights at ``weight_bits`` (16,
    or a 4-bit format's bits per weight with its scales), the bf16 router, KV cache and
    lm_head (the embedding: one row)."""
    h, heads, kv, hd = m["hidden"], m["heads"], m["kv"], m["hd"]
    linear = h * (heads + 2 * kv) * hd + heads * hd * h + m["top_k"] * 3 * h * m["inter"]
    per_layer = linear * weight_bits / 8 + 2 * (m["experts"] * h + 2 * kv * hd * context)
    return int(m["layers"] * per_layer + 2 * 4096 * h)


@dataclass
class MoEContext:
    path: Path
    size: int
    sizes: Sizes


def _prompts(count: int, length: int) -> list[list[int]]:
    return [[(17 * i + 31 * t) % 4000 + 5 for t in range(length)] for i in range(count)]


# ---------------------------------------------------------------- sections 3 and 4

def _engine_wall(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from thresher.serve_kernels import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params)
    sync()
    return time.perf_counter() - start


def section_decode_and_engine(ctx: MoEContext, log: Path) -> str:
    from thresher.serve_kernels import LLM

    s = ctx.sizes
    llm = LLM(ctx.path, dtype="bfloat16" if not DRY else "float32", max_model_len=1024,
              max_num_seqs=max(s.concurrency))
    info = llm.engine.model_info
    one = _prompts(1, s.prompt_len)
    _engine_wall(llm, one, 2)  # warm-up
    decode_s = (_engine_wall(llm, one, s.new_tokens + 1) - _engine_wall(llm, one, 1))
    rate = s.new_tokens / decode_s
    bw = copy_bandwidth(s.copy_bytes)
    per_token = bytes_per_token(s.moe, s.prompt_len + s.new_tokens)
    roof = bw / per_token
    wall, busy = step_times(llm, one[0], 16)
    rows = [f"random Qwen3-MoE {ctx.size / 1e9:.2f} GB bf16 ({s.moe}); KV cache "
            f"{info['kv_cache_bytes'] / 2**30:.1f} GiB, CUDA graphs {info.get('cuda_graphs')}\n",
            "| decode c=1 tokens/s | bytes/token | copy GB/s | roofline tokens/s | % of roofline "
            "| step wall ms | step GPU ms |", "|---|---|---|---|---|---|---|",
            f"| {rate:.0f} | {per_token / 1e6:.1f} MB | {bw / 1e9:.0f} | {roof:.0f} | "
            f"{rate / roof:.0%} | {wall * 1e3:.2f} | {_ms(busy)} |", ""]
    engine_rates = {}
    for c in s.concurrency:
        prompts = _prompts(c, s.prompt_len)
        engine_rates[c] = c * s.new_tokens / _engine_wall(llm, prompts, s.new_tokens)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    hf_rates = _hf_rates(ctx)
    rows += ["| concurrency | engine tokens/s | transformers generate tokens/s | ratio |",
             "|---|---|---|---|"]
    for c in s.concurrency:
        rows.append(f"| {c} | {engine_rates[c]:.0f} | {hf_rates[c]:.0f} | "
                    f"{engine_rates[c] / hf_rates[c]:.1f}x |")
    return "\n".join(rows)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def step_times(llm, prompt: list[int], steps: int) -> tuple[float, float | None]:
    """Median wall seconds of one c=1 decode step, and the GPU's busy time per step (the sum
    of its kernels' device times under torch.profiler; None without a GPU): their difference is
    what the host costs the step."""
    from torch.profiler import ProfilerActivity, profile

    from thresher.serve_kernels import SamplingParams

    engine = llm.engine
    engine.add_request("step-times", prompt, SamplingParams(temperature=0, max_tokens=3 * steps,
                                                            ignore_eos=True))
    engine.step()  # prefill
    walls = _step_walls(engine, steps)
    busy = None
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e6 / steps
    engine.abort_request("step-times")
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(walls)[len(walls) // 2], busy


def _step_walls(engine, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` engine steps, the device synchronised around each."""
    walls = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        walls.append(time.perf_counter() - start)
    return walls


def request_steps(llm, prompt: list[int], steps: int) -> tuple[list[float], int]:
    """Wall seconds of each step of one c=1 request of ``steps`` new tokens, its prefill first,
    and the shapes tuned (``tuning.py``) meanwhile. The first request shows what the engine does
    once per length or shape (a compile, a tile timed); a second with the same prompt, whose
    prefill meets the prefix cache (fewer new tokens: another shape), what is left."""
    from thresher.serve_kernels import SamplingParams

    engine = llm.engine
    tuned = _tuned_shapes()
    engine.add_request("request-steps", prompt, SamplingParams(temperature=0, max_tokens=steps + 1,
                                                               ignore_eos=True))
    walls = _step_walls(engine, steps + 1)  # the prefill (and the first token), then decode
    while engine.has_unfinished_requests():
        engine.step()
    return walls, _tuned_shapes() - tuned


def _tuned_shapes() -> int:
    from thresher.serve_kernels.kernels import tuning

    return sum(len(keys) for keys in tuning.chosen().values())


def _steps_cell(request: tuple[list[float], int]) -> str:
    """A request's prefill ms; its decode steps' sum, median and max (ms) and the steps over 3x
    the median; the shapes tuned during it."""
    (prefill, *walls), tuned = request
    med = sorted(walls)[len(walls) // 2]
    slow = sum(w > 3 * med for w in walls)
    return (f"{prefill * 1e3:.0f} | {sum(walls) * 1e3:.0f} / {med * 1e3:.2f} / "
            f"{max(walls) * 1e3:.1f} / {slow} | {tuned}")


def section_quantized_decode(ctx: MoEContext, log: Path,
                             left: Callable[[], float | None] = lambda: None) -> str:
    """Decode at c=1 of the random MoE in the GPTQ-4 layout, AWQ-4 and NF4 (made here on the
    device), each against the roofline of the bytes a token reads in its format. The GPTQ-4
    layout is written by RTN: the same packed bytes and kernels as GPTQ's codes, in seconds,
    where GPTQ of the 16 layers would take minutes of the run (section 6 times GPTQ itself).
    AWQ calibrates on a quarter of the samples: decode speed does not depend on them, and AWQ of
    the 16 layers on 32 took over four minutes of the third H100 run.

    The fourth run's generate rates were 20-30x below its median step times for the GPTQ-4 and
    AWQ-4 layouts (not for NF4), likely tiles timed inside a request whose prefill met the
    prefix cache (16 new rows); steps no longer time tiles (``kernels/tuning.py``). The second
    table times the prefill and every decode step of a fresh engine's first two requests and
    counts the shapes tuned in each (0 inside steps), so a cost paid once per shape shows where
    it is paid."""
    from thresher.serve_kernels import LLM

    s = ctx.sizes
    dev = "cuda" if not DRY else "cpu"
    group = 128 if not DRY else 32
    arts = {}
    for name, method, bits in ((f"GPTQ-4 layout g{group} (RTN codes)", "rtn", 4 + 32 / group),
                               (f"AWQ-4 g{group}", "awq", 4 + 32 / group),
                               ("NF4", "nf4", 4 + 32 / 64)):
        out = ctx.path.parent / method
        if method == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
            arts[name] = (out, bits)  # quantizing NF4 needs bitsandbytes; the row says so
            continue
        if not (out / "config.json").is_file():
            cmd = [sys.executable, "-m", "thresher", "quantize", "--model", str(ctx.path), "--out",
                   str(out), "--method", method, "--samples", str(max(1, s.gptq_samples // 4)),
                   "--seq-len", "128" if not DRY else "16", "--device", dev]
            if method != "nf4":
                cmd += ["--bits", "4", "--group-size", str(group)]
            run_checked(cmd, log, left())
        arts[name] = (out, bits)
    bw = copy_bandwidth(s.copy_bytes)
    rows = ["| format | decode c=1 tokens/s | bytes/token | roofline tokens/s | % of roofline "
            "| step wall ms | step GPU ms |", "|---|---|---|---|---|---|---|"]
    one = _prompts(1, s.prompt_len)
    first = ["", f"The first request of a fresh engine and a second with the same prompt (its "
             f"prefill meets the prefix cache): prefill ms; the {s.new_tokens} decode steps' sum "
             "/ median / max ms and the steps over 3x the median; shapes tuned (`tuning.py`).",
             "", "| format | CUDA graphs | 1st: prefill ms | 1st: decode | 1st: tuned | "
             "2nd: prefill ms | 2nd: decode | 2nd: tuned |", "|---|---|---|---|---|---|---|---|"]
    for name, (path, bits) in arts.items():
        if not (path / "config.json").is_file():
            why = ("bitsandbytes is not installed" if name == "NF4" else
                   f"{path.name} missing")
            rows.append(f"| {name} | not run: {why} | | | | | |")
            continue
        llm = LLM(path, dtype="bfloat16" if not DRY else "float32", max_model_len=1024,
                  max_num_seqs=1)
        requests = [request_steps(llm, one[0], s.new_tokens) for _ in range(2)]
        first.append(f"| {name} | {llm.engine.model_info.get('cuda_graphs')} | "
                     f"{_steps_cell(requests[0])} | {_steps_cell(requests[1])} |")
        _engine_wall(llm, one, 2)
        rate = s.new_tokens / (_engine_wall(llm, one, s.new_tokens + 1)
                               - _engine_wall(llm, one, 1))
        wall, busy = step_times(llm, one[0], 16)
        per_token = bytes_per_token(s.moe, s.prompt_len + s.new_tokens, bits)
        rows.append(f"| {name} | {rate:.0f} | {per_token / 1e6:.1f} MB | {bw / per_token:.0f} | "
                    f"{rate / (bw / per_token):.0%} | {wall * 1e3:.2f} | {_ms(busy)} |")
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return "\n".join(rows + first)


def _hf_rates(ctx: MoEContext) -> dict[int, float]:
    """transformers' greedy generate, same prompts and new tokens (prefill included, as above)."""
    from transformers import AutoModelForCausalLM

    s = ctx.sizes
    dtype = torch.bfloat16 if not DRY else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ctx.path, dtype=dtype).to(device()).eval()
    rates = {}
    for c in s.concurrency:
        ids = torch.tensor(_prompts(c, s.prompt_len), device=device())
        kwargs = dict(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False,
                      attention_mask=torch.ones_like(ids), pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
            sync()
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            sync()
        rates[c] = c * s.new_tokens / (time.perf_counter() - start)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rates


# ---------------------------------------------------------------- section 5: parity

PARITY_S = 45  # what one model in one dtype takes on an H100 (load, generate twice, compile)


def section_parity(bundle: Path, log: Path, left: Callable[[], float | None] = lambda: None,
                   names: tuple[str, ...] = ()) -> str:
    """Greedy tokens of the engine against transformers' ``generate`` on the device, in float32
    (the engine's fp32 dots are IEEE, and PyTorch's fp32 matmuls are by default) and in bfloat16,
    where two correct implementations round differently and part ways at near ties. Where a
    sequence diverges, transformers' logits at that step (same prefix) say how near the tie was:
    the rank of the engine's token among them and its gap to transformers' top logit. A defect
    shows as a high rank or a large gap, a rounding difference as rank 2 and a small gap.

    ``names``: the bundle's models to run (all if empty). Each row is appended to the log as it
    comes, and a model is not started with less than ``PARITY_S`` of the run's time left."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from thresher.formats.config import packed_format
    from thresher.models.quantized import load_quantized_model
    from thresher.serve_kernels import LLM, SamplingParams

    prompts = _prompts(4, 12)
    new = 24
    rows = ["| model | dtype | engine = transformers (sequences) | token agreement | first "
            "diverging step | engine's token there: worst rank, largest logit gap |",
            "|---|---|---|---|---|---|"]
    for path in parity_models(bundle, names):
        for dtype in ("float32",) if DRY else ("float32", "bfloat16"):
            remaining = left()
            if remaining is not None and remaining < PARITY_S:
                rows.append(f"| {path.name} | {dtype} | not reached: the run's time was spent "
                            "| | | |")
                continue
            torch_dtype = getattr(torch, dtype)
            if packed_format(AutoConfig.from_pretrained(path), path) is None:
                ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
            else:
                ref = load_quantized_model(path, torch_dtype)
            ref = ref.to(device()).eval()
            want, scores = [], []
            with torch.no_grad():
                for p in prompts:
                    ids = torch.tensor([p], device=device())
                    out = ref.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                       do_sample=False, attention_mask=torch.ones_like(ids),
                                       pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True)
                    want.append(out.sequences[0, len(p):].tolist())
                    scores.append([step[0].float().cpu() for step in out.logits])
            del ref
            llm = LLM(path, dtype=dtype, max_model_len=256, max_num_seqs=4, kv_cache_gb=0.25,
                      enforce_eager=True)  # parity needs no CUDA graphs: their capture is minutes
            got = [o.token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))]
            del llm
            gc.collect()
            rows.append(_parity_row(path.name, dtype, got, want, scores, new))
            print(rows[-1], flush=True)  # a run cut short by the device's limit keeps its rows
            with log.open("a") as f:
                f.write(rows[-1] + "\n")
    return "\n".join(rows)


def _parity_row(name: str, dtype: str, got: list[list[int]], want: list[list[int]],
                scores: list[list[torch.Tensor]], new: int) -> str:
    same = sum(g == w for g, w in zip(got, want, strict=True))
    agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    firsts, ranks, gaps = [], [], []
    for g, w, logits in zip(got, want, scores, strict=True):
        i = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        if i is None:
            continue
        firsts.append(i)
        step = logits[i]
        ranks.append(int((step > step[g[i]]).sum()) + 1)
        gaps.append(float(step.max() - step[g[i]]))
    near = f"{max(ranks)}, {max(gaps):.3f}" if ranks else "-"
    return (f"| {name} | {dtype} | {same}/{len(got)} | {agree / (new * len(got)):.0%} | "
            f"{min(firsts) if firsts else '-'} | {near} |")


# ---------------------------------------------------------------- sections 6 and 8: one layer

def _one_layer(ctx: MoEContext, tokenizer_dir: Path) -> Path:
    """The decode MoE's first layer alone (same seed, same weights): what sections 6 and 8
    compress on the device and on the CPU."""
    one = ctx.path.parent / "random-moe-1layer"
    if not one.exists():
        build_random_moe(one, tokenizer_dir, {**ctx.sizes.moe, "layers": 1})
    return one


def _timed(command: str, args: list[str], out: Path, dev: str, log: Path, threads: int | None,
           timeout: float | None) -> tuple[float, dict]:
    """``thresher COMMAND ... --out OUT --device DEV`` (limited to ``threads`` on the CPU): wall
    seconds and the report it writes (``quantize_report.json``, ``prune_report.json``)."""
    env = {"COLUMNS": "200"}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "thresher", command, *args, "--out", str(out), "--device", dev]
    start = time.perf_counter()
    run_checked(cmd, log, timeout, **env)
    return time.perf_counter() - start, json.loads((out / f"{command}_report.json").read_text())


def _calibration(sizes: Sizes) -> list[str]:
    return ["--samples", str(sizes.gptq_samples), "--seq-len", "128" if not DRY else "16"]


def _unfinished(dev: str, threads: int | None, exc: RuntimeError, columns: int) -> str:
    """The row of a run after the device's that did not finish: the table keeps the rows before
    it (a section that raised would lose them)."""
    why = "stopped at the run's budget" if "exited 124" in str(exc) else f"failed ({exc})"
    return (f"| first layer of the MoE | {dev} | {threads or os.cpu_count()} | not finished: {why} "
            + "| " * (columns - 4) + "|")


def _peak(report: dict) -> str:
    peak = report.get("peak_device_mb")
    return "-" if peak is None else f"{peak:.0f}"


def section_gptq(ctx: MoEContext, tokenizer_dir: Path, log: Path,
                 left: Callable[[], float | None] = lambda: None) -> str:
    """GPTQ-4 of the MoE's first layer (the same layer, same seed) on the device, then on the CPU
    with 2 threads (the 2-core machine) and with every core: seconds per layer, and the ratio."""
    one = _one_layer(ctx, tokenizer_dir)
    args = ["--model", str(one), "--method", "gptq", "--bits", "4", "--group-size",
            "128" if not DRY else "32", *_calibration(ctx.sizes)]
    runs = [("cuda" if not DRY else "cpu", None)]
    runs += [("cpu", threads) for threads in sorted({2, os.cpu_count() or 1})]
    rows = ["| checkpoint | device | threads | wall s | s / layer | peak device MiB | "
            "CPU s/layer / GPU s/layer |", "|---|---|---|---|---|---|---|"]
    first = None  # seconds per layer on the device
    for i, (dev, threads) in enumerate(runs):
        try:
            wall, report = _timed("quantize", args, ctx.path.parent / f"gptq4-1layer-{i}", dev,
                                  log, threads, left())
        except RuntimeError as exc:
            if i == 0:
                raise
            rows.append(_unfinished(dev, threads, exc, 7))
            continue
        seconds = sum(layer["seconds"] for layer in report["layers"]) / len(report["layers"])
        first = first or seconds
        ratio = "" if i == 0 else f"{seconds / first:.1f}x"
        rows.append(f"| first layer of the MoE | {report['device']} | "
                    f"{threads or torch.get_num_threads()} | {wall:.0f} | {seconds:.1f} | "
                    f"{_peak(report)} | {ratio} |")
    return "\n".join(rows)


def section_prune(ctx: MoEContext, tokenizer_dir: Path, log: Path,
                  left: Callable[[], float | None] = lambda: None) -> str:
    """REAP-50% with the refit of the MoE's first layer (the layer section 6 quantizes) with
    ``thresher prune --device cuda``, then on the CPU with 2 threads: seconds, peak device
    memory, and how many kept experts the two runs share (the same calibration tokens rank the
    experts; a different float order may swap a near tie)."""
    one = _one_layer(ctx, tokenizer_dir)
    args = ["--model", str(one), "--method", "reap", "--ratio", "0.5", "--refit",
            *_calibration(ctx.sizes)]
    rows = ["| checkpoint | device | threads | wall s | peak device MiB | experts kept | "
            "kept as on the device |", "|---|---|---|---|---|---|---|"]
    first: list[int] | None = None
    for i, (dev, threads) in enumerate([("cuda" if not DRY else "cpu", None), ("cpu", 2)]):
        try:
            wall, report = _timed("prune", args, ctx.path.parent / f"reap-1layer-{i}", dev, log,
                                  threads, left())
        except RuntimeError as exc:
            if i == 0:
                raise
            rows.append(_unfinished(dev, threads, exc, 7))
            continue
        kept = [e for layer in report["layers"] for e in layer["kept"]]
        first = kept if first is None else first
        same = "" if i == 0 else f"{len(set(kept) & set(first))} of {len(first)}"
        rows.append(f"| first layer of the MoE | {report['device']} | "
                    f"{threads or torch.get_num_threads()} | {wall:.0f} | {_peak(report)} | "
                    f"{len(kept)} | {same} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- preparing and running

def prepare(bundle: Path, demos: list[str]) -> None:
    """Write the bundle to carry: the demo models as thresher's state directory holds them
    (``BUNDLE/demo-models/<name>-<hash>``, named in ``pinned.json``: with ``THRESHER_HOME=BUNDLE``
    the tests use them instead of training them, although the GPU machine's standard library, and
    so its own key, differs) and their GPTQ-4, AWQ-4 and NF4 artifacts (``BUNDLE/artifacts``)."""
    from thresher.data.demo_model import PINNED, build_demo_model

    (bundle / "demo-models").mkdir(parents=True, exist_ok=True)
    (bundle / "artifacts").mkdir(exist_ok=True)
    pinned_file = bundle / "demo-models" / PINNED
    pinned = json.loads(pinned_file.read_text()) if pinned_file.is_file() else {}
    for name in demos:
        src = build_demo_model(name)
        base = bundle / "demo-models" / src.name
        if not base.exists():
            shutil.copytree(src, base)
        pinned[name] = src.name
        pinned_file.write_text(json.dumps(pinned, indent=2))
        for method, args in DEMO_QUANT.items():
            out = bundle / "artifacts" / f"demo-{name}-{method}"
            if out.exists():
                continue
            cmd = [sys.executable, "-m", "thresher", "quantize", "--model", str(base), "--out",
                   str(out), *args, "--samples", "8", "--seq-len", "64"]
            subprocess.run(cmd, cwd=ROOT, check=True, env=child_env())
    for family in CORRECTION_ROUTED:
        if not (bundle / "artifacts" / f"{family}-random").exists():
            write_random_glm(bundle / "artifacts" / f"{family}-random", build_demo_model("tiny"),
                             family)
    if not (bundle / "artifacts" / "gpt_oss-random").exists():
        write_random_gpt_oss(bundle / "artifacts" / "gpt_oss-random", build_demo_model("tiny"))
    total = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    print(f"bundle {bundle}: {total / 2**20:.1f} MiB")


# What a GPU machine without network needs beyond its image, at this environment's versions:
# thresher.recipe's pydantic (a release pins one pydantic-core) and NF4's bitsandbytes.
CARRIED_WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
BNB_LIBS_KEPT = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda13")  # 8 of the wheel's 41 MB


def pack_carry(bundle: Path, carry: Path) -> None:
    """``carry``: the bundle as ``bundle.tar.xz``, the pinned wheels in ``whl/`` and bitsandbytes
    unpacked in ``site/`` with its CPU and CUDA 13 libraries only, so that all of it fits the
    device tool's 64 MiB beside the source tree (44 MiB with ``--demos tiny``)."""
    import importlib.metadata
    import lzma
    import tarfile
    import zipfile

    whl = carry / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    platform = ["--only-binary=:all:", "--no-deps", "--python-version", "3.12",
                "--implementation", "cp", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_28_x86_64"]
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED_WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *platform, "-d", str(whl),
                    *pins], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", *platform, "-d", tmp,
                        f"bitsandbytes=={importlib.metadata.version('bitsandbytes')}"],
                       check=True)
        with zipfile.ZipFile(next(Path(tmp).glob("bitsandbytes-*.whl"))) as z:
            keep = [n for n in z.namelist()
                    if "/libbitsandbytes_" not in n or any(k in n for k in BNB_LIBS_KEPT)]
            z.extractall(carry / "site", keep)
    with lzma.open(carry / "bundle.tar.xz", "wb", preset=6) as xz, \
            tarfile.open(fileobj=xz, mode="w") as tar:
        tar.add(bundle, arcname="gpu_bundle")
    total = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())
    print(f"carry {carry}: {total / 2**20:.1f} MiB (the device tool takes 64 MiB with the tree)")


def unpack_carry(carry: Path) -> Path:
    """On the GPU machine: install ``carry``'s wheels and bitsandbytes into this Python's own
    site-packages (so every child process sees them) and unpack the bundle; its path."""
    import sysconfig
    import tarfile

    wheels = sorted(str(w) for w in (carry / "whl").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", *wheels], check=True)
    shutil.copytree(carry / "site", sysconfig.get_paths()["purelib"], dirs_exist_ok=True)
    importlib.invalidate_caches()
    work = Path(tempfile.mkdtemp(prefix="thresher-gpu-bundle-"))
    with tarfile.open(carry / "bundle.tar.xz") as tar:
        tar.extractall(work, filter="data")
    return work / "gpu_bundle"


# Families whose router selects with a score-correction bias, in the parity section: GLM-4.5's
# sigmoid router (DeepSeek-V3 adds latent attention) and ERNIE-4.5's softmax one.
CORRECTION_ROUTED = ("glm4_moe", "deepseek_v3", "ernie4_5_moe")


def write_random_glm(out: Path, tokenizer_dir: Path, model_type: str = "glm4_moe") -> None:
    """A random GLM-4.5 (or DeepSeek-V3, ERNIE-4.5) checkpoint and its GPTQ-4 artifact (``out`` and
    ``out``-gptq4) for the parity section: routers and correction biases drawn wide enough to
    route unevenly, weights wide enough that the greedy tokens are not near ties."""
    from transformers import AutoModelForCausalLM

    from thresher.models import save_model
    from thresher.models.random_init import random_config

    torch.manual_seed(0)
    config = random_config(model_type, hidden_size=128, vocab_size=4096, intermediate_size=64,
                           initializer_range=0.08)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                t.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                t.uniform_(-0.2, 0.2)
    save_model(model, None, out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    cmd = [sys.executable, "-m", "thresher", "quantize", "--model", str(out), "--out",
           f"{out}-gptq4", *DEMO_QUANT["gptq4"], "--samples", "8", "--seq-len", "64"]
    subprocess.run(cmd, cwd=ROOT, check=True, env=child_env())


def write_random_gpt_oss(out: Path, tokenizer_dir: Path) -> None:
    """A random gpt-oss checkpoint (a 16-token window, so that the parity prompts cross it) and
    its GPTQ-4 artifact (``out`` and ``out``-gptq4) for the parity section: router, biases and
    sinks drawn wide enough to matter."""
    from transformers import AutoModelForCausalLM

    from thresher.models import save_model
    from thresher.models.random_init import random_config

    torch.manual_seed(0)
    config = random_config("gpt_oss", hidden_size=128, vocab_size=4096, intermediate_size=64,
                           num_layers=4, sliding_window=16, initializer_range=0.08)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if ".router." in name:
                t.normal_(0, 0.5)
            elif name.endswith("_bias") and ".experts." in name:
                t.normal_(0, 0.1)
            elif name.endswith("self_attn.sinks"):
                t.normal_(0, 1.0)
    save_model(model, None, out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    cmd = [sys.executable, "-m", "thresher", "quantize", "--model", str(out), "--out",
           f"{out}-gptq4", *DEMO_QUANT["gptq4"], "--samples", "8", "--seq-len", "64"]
    subprocess.run(cmd, cwd=ROOT, check=True, env=child_env())


def parity_models(bundle: Path, names: tuple[str, ...] = ()) -> list[Path]:
    """The demo models and their artifacts in a bundle, base models first; only those in
    ``names`` if given (an unknown name is an error that lists the bundle's models)."""
    bases = sorted(p for p in (bundle / "demo-models").iterdir() if (p / "config.json").is_file())
    arts = bundle / "artifacts"
    found = bases + (sorted(p for p in arts.iterdir() if (p / "config.json").is_file())
                     if arts.is_dir() else [])
    unknown = sorted(set(names) - {p.name for p in found})
    if unknown:
        raise ValueError(f"--parity-models: {', '.join(unknown)} not in the bundle (it has "
                         f"{', '.join(p.name for p in found)})")
    return [p for p in found if not names or p.name in names]


SECTIONS = ("tests", "gemv", "moe", "decode", "parity", "qdecode", "gptq", "prune")
EXTRA_SECTIONS = ("cuda",)  # by name only: the engine tests without the kernel tests


def run_sections(out: Path, bundle: Path | None, order: tuple[str, ...] = SECTIONS,
                 budget_s: float | None = None, parity_names: tuple[str, ...] = ()) -> None:
    """Run the sections named in ``order``; once ``budget_s`` has passed, the rest are reported
    as skipped, so a run under a device's time limit still ends with every table it made."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    out.mkdir(parents=True, exist_ok=True)
    log, report = out / "gpu_suite.log", out / "gpu_suite.md"
    log.write_text("")
    sizes = TOY if DRY else GPU
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)"
    header = (f"# GPU suite: {name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
              f"torch {torch.__version__}, dry run {DRY}\n")
    report.write_text(header + "\n")
    print(header)
    work = Path(tempfile.mkdtemp(prefix="thresher-gpu-suite-"))
    if bundle is not None:  # the tests' demo:tiny fixture reads thresher's state directory
        os.environ["THRESHER_HOME"] = str(bundle.resolve())
    from thresher.data.demo_model import build_demo_model

    tokenizer_dir = build_demo_model("tiny")
    ctx: MoEContext | None = None

    def moe() -> MoEContext:
        nonlocal ctx
        if ctx is None:
            path = work / "random-moe"
            ctx = MoEContext(path, build_random_moe(path, tokenizer_dir, sizes.moe), sizes)
        return ctx

    parity_dir = bundle
    if parity_dir is None:  # a dry run without a bundle: the tiny demo, random GLM-4.5 and DSV3
        parity_dir = work / "parity"
        (parity_dir / "demo-models").mkdir(parents=True)
        shutil.copytree(tokenizer_dir, parity_dir / "demo-models" / tokenizer_dir.name)
        for family in CORRECTION_ROUTED:
            write_random_glm(parity_dir / "artifacts" / f"{family}-random", tokenizer_dir, family)
        write_random_gpt_oss(parity_dir / "artifacts" / "gpt_oss-random", tokenizer_dir)
    def left() -> float | None:
        return None if deadline is None else max(1.0, deadline - time.monotonic())

    sections = {"tests": ("1. tests", lambda: section_tests(sizes, log, left())),
                "cuda": ("1. cuda engine tests",
                         lambda: section_tests(sizes, log, left(), kernels=False)),
                "gemv": ("2. W4A16 / NF4 GEMV at M=1", lambda: section_gemv(sizes, log)),
                "moe": ("2b. fused W4A16 MoE kernel at decode shapes",
                        lambda: section_moe_kernel(sizes, log)),
                "decode": ("3-4. decode roofline, engine vs transformers",
                           lambda: section_decode_and_engine(moe(), log)),
                "parity": ("5. greedy parity with transformers",
                           lambda: section_parity(parity_dir, log, left, parity_names)),
                "qdecode": ("7. decode of the quantized MoE (GPTQ-4 layout, AWQ-4, NF4)",
                            lambda: section_quantized_decode(moe(), log, left)),
                "gptq": ("6. GPTQ-4 of one MoE layer on the device and on the CPU",
                         lambda: section_gptq(moe(), tokenizer_dir, log, left)),
                "prune": ("8. REAP-50% with the refit of one MoE layer on the device and the CPU",
                          lambda: section_prune(moe(), tokenizer_dir, log, left))}
    try:
        for key in order:
            title, fn = sections[key]
            if deadline is not None and time.monotonic() > deadline:
                text = f"## {title}\n\nSKIPPED: the run's time (--budget-s) was spent\n"
                print(text, flush=True)
                with report.open("a") as f:
                    f.write(text + "\n")
                continue
            start = time.perf_counter()
            try:
                table = fn()
            except Exception as exc:  # report and go on: one broken section must not cost the rest
                with log.open("a") as f:
                    f.write(f"## {title}\n{traceback.format_exc()}\n")
                table = f"FAILED: {type(exc).__name__}: {exc}"
            text = f"## {title} ({time.perf_counter() - start:.0f} s)\n\n{table}\n"
            print(text, flush=True)
            with report.open("a") as f:
                f.write(text + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"tables: {report}; log: {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", type=Path, help="write the bundle to carry to the GPU machine")
    ap.add_argument("--demos", nargs="+", default=["tiny", "small"], choices=["tiny", "small"],
                    help="--prepare: the demo models to bundle with their artifacts")
    ap.add_argument("--bundle", type=Path, help="the prepared bundle (demo models, artifacts)")
    ap.add_argument("--carry", type=Path,
                    help="with --prepare: also pack the bundle and the wheels a GPU machine without "
                         "network needs into this folder; on the GPU: install and unpack it "
                         "(instead of --bundle)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/gpu_suite"))
    ap.add_argument("--dry-run", action="store_true",
                    help="every section at toy sizes on the CPU (kernels through the interpreter)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated sections to run, in this order (of "
                         f"{','.join(SECTIONS + EXTRA_SECTIONS)})")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run: sections that would start later are skipped, "
                         "and the tests' pytest is stopped at it")
    ap.add_argument("--parity-models", nargs="+", default=[], metavar="NAME",
                    help="the bundle's models the parity section runs (default: all), e.g. "
                         "glm4_moe-random demo-tiny-nf4")
    args = ap.parse_args()
    order = tuple(x.strip() for x in args.sections.split(",") if x.strip())
    known = SECTIONS + EXTRA_SECTIONS
    unknown = [x for x in order if x not in known]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if args.prepare:
        prepare(args.prepare, args.demos)
        if args.carry:
            pack_carry(args.prepare, args.carry)
        return
    if not DRY and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    if args.carry:
        args.bundle = unpack_carry(args.carry)
    if not DRY and args.bundle is None:
        raise SystemExit("--bundle is required on the GPU (made by --prepare on the CPU machine)")
    if args.parity_models and args.bundle is not None:
        try:  # a misspelt name fails here, not minutes into the run
            parity_models(args.bundle, tuple(args.parity_models))
        except ValueError as exc:
            ap.error(str(exc))
    run_sections(args.out, args.bundle, order, args.budget_s, tuple(args.parity_models))


if __name__ == "__main__":
    main()
