"""The llm-compressor side of ``peer_quality.py``; runs inside a separate llm-compressor venv.

Not imported by thresher (llm-compressor pins its own transformers and compressed-tensors): the
benchmark calls

    PEER_PYTHON benchmarks/peers/peer_worker.py < request.json

with a JSON request on stdin and reads one line ``RESULT {...}`` from stdout. The request names
the checkpoint (``path``), the calibration windows and the held-out windows (token ids, exactly
thresher's), and one run: ``method`` ``float`` (score the unquantized model: checks that both
sides compute the same perplexity), ``gptq`` or ``awq``, with ``bits`` and ``group_size``. The
model is quantized in memory by ``oneshot`` and scored right after it: compressed-tensors leaves
every quantized Linear with its scales and zero points, and its fake-quantized weight (written
into the weight here, and checked to have at most 2**bits levels per group) is what the
compressed checkpoint would hold.

Perplexity is thresher's definition (thresher/evaluate/perplexity.py): token-level, every window
scored on its own, exp(summed NLL of the n - 1 predictions of each window / their count).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

# the router stays in 16 bits on both sides (thresher's keep_16bit: router, embeddings, lm_head)
IGNORE = ["lm_head", "re:.*mlp\\.gate$"]


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int) -> dict:
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        logits = model(input_ids=batch).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        total += float(-logprobs.gather(-1, batch[:, 1:].unsqueeze(-1)).sum())
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    return {"perplexity": math.exp(total / tokens), "nll": total / tokens, "tokens": tokens}


def cpu_only_workarounds() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations (a host-to-device speed-up) even
    with no accelerator, where pinning raises; on a CPU-only machine pinning is a no-op here."""
    if torch.cuda.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def recipe(method: str, bits: int, group_size: int, symmetric: bool) -> list:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group",
                               group_size=group_size, dynamic=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    if method == "gptq":
        # actorder "static" (the default): columns in descending Hessian order, groups fitted up
        # front in the original order -- thresher's act_order with static_groups
        return [GPTQModifier(config_groups={"group_0": scheme}, ignore=IGNORE,
                             actorder="static", dampening_frac=0.01, block_size=128)]
    if method == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        # offload_device None: its MoE default (cpu) pins memory, which needs an accelerator
        return [AWQModifier(duo_scaling=True, offload_device=None),
                QuantizationModifier(config_groups={"group_0": scheme}, ignore=IGNORE)]
    raise ValueError(f"unknown method {method!r}")


def bake_fake_quant(model, bits: int, group_size: int) -> int:
    """Write each quantized Linear's fake-quantized weight into the weight itself, so the forward
    that scores the model uses it whatever compressed-tensors' forward does (fake quantization is
    idempotent: GPTQ already left its weights on the grid); raises if a group holds more than
    2**bits levels. Returns how many Linears are quantized."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    count = 0
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None or not isinstance(module, torch.nn.Linear):
            continue
        with torch.no_grad():
            w = forward_quantize(module, module.weight, "weight", scheme.weights)
            module.weight.copy_(w)
        groups = w.reshape(-1, group_size)
        levels = max(int(torch.unique(g).numel()) for g in groups[:: max(1, len(groups) // 64)])
        if levels > 2**bits:
            raise RuntimeError(f"{name}: weight not on a {bits}-bit grid ({levels} levels)")
        count += 1
    if count == 0:
        raise RuntimeError("no quantized Linear after oneshot")
    return count


def run(req: dict) -> dict:
    import compressed_tensors
    import llmcompressor
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    heldout = torch.tensor(req["heldout"], dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(req["path"], dtype=torch.float32)
    out = {"versions": {"llmcompressor": llmcompressor.__version__,
                        "compressed_tensors": compressed_tensors.__version__,
                        "transformers": transformers.__version__, "torch": torch.__version__}}
    start = time.perf_counter()
    if req["method"] != "float":
        from llmcompressor import oneshot
        from torch.utils.data import DataLoader

        cpu_only_workarounds()

        windows = torch.tensor(req["calibration"], dtype=torch.long)
        data = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in windows]
        loader = DataLoader(data, batch_size=req.get("calibration_batch", 8), shuffle=False)
        model = oneshot(model=model, dataset=loader, recipe=recipe(
            req["method"], req["bits"], req["group_size"], req["symmetric"]),
            num_calibration_samples=len(data), max_seq_length=windows.shape[1],
            moe_calibrate_all_experts=req.get("all_experts", False))
        out["quantized_linears"] = bake_fake_quant(model, req["bits"], req["group_size"])
    out["seconds"] = time.perf_counter() - start
    out.update(perplexity(model, heldout, req.get("batch_size", 8)))
    return out


def main() -> None:
    req = json.loads(sys.stdin.read())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print("RESULT " + json.dumps(run(req)), flush=True)


if __name__ == "__main__":
    main()
