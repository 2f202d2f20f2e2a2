"""The host part of a decode step at serving scale: everything ``engine.step()`` does but the model.

    PYTHONPATH=. python benchmarks/engine/decode_step_host.py [--seqs 64 --blocks 2048]

On a GPU the device runs the forward while the host prepares the next step, so host work per step
is a floor on the step time whatever the kernels do. This benchmark measures that floor on the
CPU: ``--seqs`` greedy sequences each holding ``--blocks`` cached KV blocks (block size 16, so
2,048 blocks is a 32,768-token context) decode together, and the model's forward and logits are
replaced by precomputed outputs, so a step is scheduling, block-table and slot preparation,
sampling (an argmax over the vocabulary), the per-sequence update, detokenization with the demo
model's tokenizer and the outputs. The model is a one-layer random Qwen3 (the engine still loads
a checkpoint and sizes a KV cache for the context).

Reported: the median wall time of a step and its median process CPU time (which waiting for a
core on a loaded machine does not add to), with one torch thread.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from thresher.data.demo_model import build_demo_model
from thresher.models.random_init import random_config
from thresher.prune.api import TOKENIZER_FILES
from thresher.serve_kernels import SamplingParams
from thresher.serve_kernels.engine.llm_engine import LLMEngine

BLOCK_SIZE = 16
VOCAB = 4096  # the demo tokenizer's
ROOM = 8 * BLOCK_SIZE  # tokens each sequence may generate: none finishes while it is measured


def build_checkpoint(out: Path, max_len: int) -> None:
    """A one-layer random Qwen3 with the demo tokenizer and room for ``max_len`` positions."""
    config = random_config("qwen3", hidden_size=32, num_layers=1, vocab_size=VOCAB,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           max_position_embeddings=max_len, dtype="bfloat16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    tok_dir = build_demo_model("tiny")
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, out / name)


def stub_model(engine: LLMEngine) -> None:
    """Replace the forward and the logits by precomputed outputs (random logits, so the argmax
    and the detokenized text change from step to step)."""
    model = engine.runner.model
    hidden = torch.zeros(1 << 16, model.spec.hidden_size, dtype=model.embed_tokens.dtype)
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(engine.scheduler.max_num_seqs, VOCAB, generator=gen) for _ in range(7)]
    calls = iter(range(1 << 62))

    def forward(input_ids, positions, kv_caches, meta):
        return hidden[: input_ids.shape[0]]

    def logits(rows):
        return pool[next(calls) % len(pool)][: rows.shape[0]]

    model.forward = forward
    model.logits = logits


def decoding_engine(path: Path, seqs: int, blocks: int) -> LLMEngine:
    """``seqs`` greedy requests, prefilled to ``blocks`` full blocks each minus one token."""
    prompt_len = blocks * BLOCK_SIZE - 1
    engine = LLMEngine(path, dtype="bfloat16", max_num_seqs=seqs, block_size=BLOCK_SIZE,
                       max_num_batched_tokens=1 << 16, num_kv_blocks=seqs * (blocks + 8),
                       max_model_len=prompt_len + ROOM, enable_prefix_caching=False)
    stub_model(engine)
    gen = torch.Generator().manual_seed(1)
    for i in range(seqs):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=ROOM,
                                                           ignore_eos=True))
    while len(engine.scheduler.running) < seqs or any(
            s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    return engine


def measure(engine: LLMEngine, steps: int) -> tuple[float, float]:
    """Median wall and process CPU milliseconds of ``steps`` decode steps."""
    for _ in range(2):
        engine.step()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_checkpoint(path, args.blocks * BLOCK_SIZE + ROOM)
        engine = decoding_engine(path, args.seqs, args.blocks)
        room = min(s.max_tokens - s.num_output_tokens for s in engine.scheduler.running)
        wall_ms, cpu_ms = measure(engine, min(args.steps, room - 3))
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print(f"{args.seqs} sequences x {args.blocks} blocks: host step {wall_ms:.2f} ms wall, "
          f"{cpu_ms:.2f} ms process CPU")


if __name__ == "__main__":
    main()
