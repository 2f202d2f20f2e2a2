"""Scale: GPTQ-4 on a random-init MoE checkpoint of several GB, with the peak memory it takes.

    python benchmarks/scale/quant_scale.py                     # 56 layers, about 6 GB in bf16
    python benchmarks/scale/quant_scale.py --layers 4          # a quick trial of the same shapes

Builds a Qwen3-MoE checkpoint with Mixtral's expert layout scaled down (hidden 1024, 8 experts
of 2048, top-2; bf16) on disk one layer at a time, with the tokenizer of the ``tiny`` demo model,
then runs ``thresher quantize --method gptq`` on it as a separate process; the peak resident set
is the one its quantize report measured (``thresher.resources``, the one definition of peak
memory). The sequential driver keeps one decoder layer resident, so the peak resident set should
be a small fraction of the checkpoint (the goal: at most 25%). Prints a table; the checkpoint is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from thresher.data.demo_model import build_demo_model
from thresher.formats.artifact import QUANTIZE_REPORT
from thresher.models.checkpoint import CheckpointWriter
from thresher.models.random_init import random_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_checkpoint(out: Path, layers: int, hidden: int, experts: int, inter: int,
                     top_k: int) -> int:
    """Write a random bf16 Qwen3-MoE checkpoint layer by layer; return its size in bytes."""
    tok_dir = build_demo_model("tiny")
    config = random_config("qwen3_moe", hidden_size=hidden, num_layers=layers,
                           num_experts=experts, top_k=top_k, intermediate_size=inter,
                           vocab_size=4096, num_attention_heads=16, num_key_value_heads=4,
                           head_dim=64, dtype="bfloat16")
    config.architectures = ["Qwen3MoeForCausalLM"]  # save_pretrained alone omits it; vLLM needs it
    out.mkdir(parents=True)
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, out / name)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    heads, kv, hd = 16, 4, 64
    writer = CheckpointWriter(out, max_shard_bytes=512 << 20)
    writer.add({"model.embed_tokens.weight": rand(4096, hidden),
                "lm_head.weight": rand(4096, hidden),
                "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        state = {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(heads * hd, hidden),
            p + "self_attn.k_proj.weight": rand(kv * hd, hidden),
            p + "self_attn.v_proj.weight": rand(kv * hd, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * hd),
            p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "mlp.gate.weight": rand(experts, hidden) * 50,  # a router with preferences
        }
        for e in range(experts):
            state[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
            state[p + f"mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
            state[p + f"mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter)
        writer.add(state)
        print(f"\rbuilding layer {i + 1}/{layers}", end="", file=sys.stderr, flush=True)
    writer.close()
    print(file=sys.stderr)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def build_deepseek_v3_checkpoint(out: Path, layers: int, hidden: int, experts: int, inter: int,
                                 top_k: int) -> int:
    """Write a random bf16 DeepSeek-V3-shaped checkpoint layer by layer: one dense first layer
    (intermediate 4 x ``inter``) and ``layers`` MoE layers of ``experts`` routed experts of
    ``inter`` plus one shared expert, a sigmoid router with a correction bias and 4 groups of
    which 2 are kept, and multi-head latent attention (16 heads; query rank 3/8 of hidden, kv
    latent 128, rotary keys 32, nope 64, values 64); hub tensor names. Returns its size."""
    tok_dir = build_demo_model("tiny")
    heads, q_rank, kv_rank, rope, nope, vdim = 16, hidden * 3 // 8, 128, 32, 64, 64
    config = random_config("deepseek_v3", hidden_size=hidden, num_layers=layers,
                           num_experts=experts, top_k=top_k, intermediate_size=inter,
                           vocab_size=4096, num_attention_heads=heads, num_key_value_heads=heads,
                           q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_rope_head_dim=rope,
                           qk_nope_head_dim=nope, v_head_dim=vdim, n_group=4, topk_group=2,
                           num_nextn_predict_layers=0, dtype="bfloat16")
    config.intermediate_size = 4 * inter  # the dense first layer's
    config.architectures = ["DeepseekV3ForCausalLM"]
    out.mkdir(parents=True)
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, out / name)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    def mlp(prefix: str, width: int) -> dict[str, torch.Tensor]:
        return {prefix + "gate_proj.weight": rand(width, hidden),
                prefix + "up_proj.weight": rand(width, hidden),
                prefix + "down_proj.weight": rand(hidden, width)}

    writer = CheckpointWriter(out, max_shard_bytes=512 << 20)
    writer.add({"model.embed_tokens.weight": rand(4096, hidden),
                "lm_head.weight": rand(4096, hidden), "model.norm.weight": ones(hidden)})
    for i in range(layers + 1):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        state = {p + "input_layernorm.weight": ones(hidden),
                 p + "post_attention_layernorm.weight": ones(hidden),
                 a + "q_a_proj.weight": rand(q_rank, hidden),
                 a + "q_a_layernorm.weight": ones(q_rank),
                 a + "q_b_proj.weight": rand(heads * (nope + rope), q_rank),
                 a + "kv_a_proj_with_mqa.weight": rand(kv_rank + rope, hidden),
                 a + "kv_a_layernorm.weight": ones(kv_rank),
                 a + "kv_b_proj.weight": rand(heads * (nope + vdim), kv_rank),
                 a + "o_proj.weight": rand(hidden, heads * vdim)}
        if i == 0:  # first_k_dense_replace = 1
            state.update(mlp(p + "mlp.", 4 * inter))
        else:
            state[p + "mlp.gate.weight"] = rand(experts, hidden) * 50  # a router with preferences
            state[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
            state.update(mlp(p + "mlp.shared_experts.", inter))
            for e in range(experts):
                state.update(mlp(p + f"mlp.experts.{e}.", inter))
        writer.add(state)
        print(f"\rbuilding layer {i + 1}/{layers + 1}", end="", file=sys.stderr, flush=True)
    writer.close()
    print(file=sys.stderr)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def build_gpt_oss_checkpoint(out: Path, layers: int, hidden: int, experts: int, inter: int,
                             top_k: int) -> int:
    """Write a random bf16 gpt-oss-shaped checkpoint: sliding (128-token window) and full layers
    alternating, attention sinks and biases (heads of 64, 4 kv heads), a biased router, fused
    experts with biases in the hub's 16-bit layout (``gate_up_proj`` interleaving gate and up),
    YaRN as gpt-oss ships it. Returns its size."""
    config = random_config(
        "gpt_oss", hidden_size=hidden, num_layers=layers, num_experts=experts, top_k=top_k,
        intermediate_size=inter, vocab_size=4096, num_attention_heads=hidden // 64,
        num_key_value_heads=min(4, hidden // 64), head_dim=64, sliding_window=128,
        max_position_embeddings=131072, dtype="bfloat16",
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096})
    config.architectures = ["GptOssForCausalLM"]
    return _save_random(config, out, (".router.weight", "self_attn.sinks"))


def build_qwen3_5_checkpoint(out: Path, layers: int, hidden: int, experts: int, inter: int,
                             top_k: int) -> int:
    """Write a random bf16 Qwen3.5-MoE-shaped text checkpoint: Gated DeltaNet and gated full
    attention layers alternating (3:1 on the hub; 1:1 here, as the test models), a gated shared
    expert of 2 x ``inter``; full attention of 8 heads of 128 over 2 kv heads, rotary over a
    quarter; linear attention of 8 key heads and 16 value heads of 64, a 4-tap conv. Returns its
    size."""
    config = random_config(
        "qwen3_5_moe", hidden_size=hidden, num_layers=layers, num_experts=experts, top_k=top_k,
        intermediate_size=inter, vocab_size=4096, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
        linear_value_head_dim=64, max_position_embeddings=4096, dtype="bfloat16")
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    return _save_random(config, out, ("mlp.gate.weight",))


def _save_random(config, out: Path, preferring: tuple[str, ...]) -> int:
    """transformers' own random init of ``config`` saved with the demo tokenizer; parameters
    ending in ``preferring`` (routers, sinks) drawn at unit scale so that they choose."""
    from transformers import AutoModelForCausalLM

    tok_dir = build_demo_model("tiny")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(preferring):
                t.normal_(0, 1.0)
    model.save_pretrained(out, max_shard_size="512MB")
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, out / name)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=56)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the artifact")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="thresher-scale-", dir=args.dir))
    try:
        src, out = root / "model", root / "gptq4"
        start = time.perf_counter()
        size = build_checkpoint(src, args.layers, args.hidden, args.experts, args.intermediate,
                                args.top_k)
        build_s = time.perf_counter() - start
        cmd = [sys.executable, "-m", "thresher", "quantize",
               "--model", str(src), "--out", str(out), "--method", "gptq", "--bits", "4",
               "--group-size", "128", "--samples", str(args.samples),
               "--seq-len", str(args.seq_len)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        quant_s = time.perf_counter() - start
        if proc.returncode:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"quantize failed with exit status {proc.returncode}")
        report = json.loads((out / QUANTIZE_REPORT).read_text())["metrics"]
        rss = report["peak_rss_mb"] * 2**20
        art = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        params = size / 2
        print(f"\nrandom-init qwen3_moe: {args.layers} layers, hidden {args.hidden}, "
              f"{args.experts} experts x {args.intermediate} (top-{args.top_k}), "
              f"{params / 1e9:.2f} B parameters; GPTQ-4 g128 on {args.samples} x {args.seq_len} "
              f"calibration tokens; torch threads {torch.get_num_threads()}\n")
        print("| checkpoint (bf16) | GPTQ-4 artifact | build s | quantize s | peak RSS | "
              "peak RSS / checkpoint | fallback experts |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {size / 1e9:.2f} GB | {art / 1e9:.2f} GB | {build_s:.0f} | {quant_s:.0f} | "
              f"{rss / 1e9:.2f} GB | {rss / size:.1%} | {report['fallback_experts']:.0f} / "
              f"{args.layers * args.experts} |")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
