"""Generative-task decoding: the serving engine against the reference lm-eval wrapper.

    .venv/bin/python benchmarks/engine/task_generation.py [tiny|small] [--prompts 16]

Both decode the first ``--prompts`` prompts of ``stdlib_complete_line`` greedily (32 new tokens
each, the task's own settings): ``ThresherLM`` re-runs the whole sequence per token, one request
at a time; ``EngineLM`` decodes them together from the engine's paged KV cache. Prints wall
time, tokens per second, the speed-up, and whether the two wrote the same text.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from lm_eval.api.instance import Instance

from thresher.data.demo_model import build_demo_model
from thresher.evaluate.builtin_tasks import prepare_builtin_tasks
from thresher.evaluate.engine_lm import EngineLM
from thresher.evaluate.lm_wrapper import ThresherLM
from thresher.models import load_model, load_tokenizer

TASK = "stdlib_complete_line"
MAX_GEN_TOKS = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("size", nargs="?", default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    path = build_demo_model(args.size)
    lines = (prepare_builtin_tasks() / f"{TASK}.jsonl").read_text().splitlines()[: args.prompts]
    kwargs = {"until": ["<|endoftext|>"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False}
    requests = [Instance("generate_until", {}, (json.loads(line)["context"], kwargs), i)
                for i, line in enumerate(lines)]
    rows = []
    for name, make in (("reference (ThresherLM)",
                        lambda: ThresherLM(load_model(path), load_tokenizer(path),
                                           show_progress=False)),
                       ("engine (EngineLM)", lambda: EngineLM(path, show_progress=False))):
        lm = make()
        start = time.perf_counter()
        texts = lm.generate_until(requests)
        wall = time.perf_counter() - start
        tokens = sum(len(lm.tok_encode(t)) for t in texts)
        rows.append((name, wall, tokens, texts))
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; {time.strftime('%Y-%m-%d')}; demo:{args.size}; {TASK}: "
          f"{args.prompts} prompts, up to {MAX_GEN_TOKS} new tokens each\n")
    print("| decoder | wall (s) | generated tokens | tok/s | speed-up |")
    print("|---|---|---|---|---|")
    for name, wall, tokens, _ in rows:
        print(f"| {name} | {wall:.1f} | {tokens} | {tokens / wall:.1f} | "
              f"{rows[0][1] / wall:.1f}x |")
    print(f"\nsame text: {rows[0][3] == rows[1][3]}")


if __name__ == "__main__":
    main()
