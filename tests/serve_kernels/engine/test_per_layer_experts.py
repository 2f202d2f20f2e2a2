"""The engine on a damage-budget checkpoint (MoE layers keeping different expert counts) of the
trained tiny demo model, 16-bit and quantized, against thresher's own loader.

The engine's torch kernels compute in fp32 from the same weights (or codes) as ``load_model``, so
greedy continuations agree token for token; the CPU int4 and NF4 kernels run in bf16 and are
teacher-forced through the reference, as in test_cpu_int4_generate.py.
"""

from __future__ import annotations

import json.decoder

import pytest
import torch

from tests.serve_kernels.conftest import assert_tracks_reference, prompt_pass
from thresher.cli import _describe_loaded
from thresher.compress.api import quantize_model
from thresher.models import load_model
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams

CAL = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=4, seq_len=32)
PROMPTS = [[5, 17, 300, 42, 9, 77], [1023, 4000, 12, 3, 250], [61, 8, 99, 1500, 31, 7, 2, 640]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def reference_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    """thresher's ``load_model`` (per-layer experts, dequantizing on the fly) decoding greedily."""
    model = load_model(path)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens,
                               min_new_tokens=GREEDY.max_tokens, do_sample=False
                               )[0, len(p):].tolist() for p in prompts]


def expert_counts(llm: LLM) -> list[int]:
    return [layer.mlp.router.out_features for layer in llm.engine.runner.model.layers]


def test_16bit_damage_budget_checkpoint_matches_thresher_loader(tiny_damage_pruned):
    path, counts = tiny_damage_pruned
    llm = LLM(path)
    assert expert_counts(llm) == counts
    assert llm.engine.model_info["layer_num_experts"] == counts
    startup = _describe_loaded("pruned", llm.engine.model_info, 256)  # `thresher serve` prints it
    assert f"experts per layer {'/'.join(map(str, counts))}" in startup
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference_greedy(path, PROMPTS)


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="gptq", group_size=32, act_order=True),
    QuantizeStage(method="awq", group_size=32),
    QuantizeStage(method="nf4", double_quant=True),
], ids=["gptq", "awq", "nf4"])
def test_quantized_damage_budget_checkpoint_matches_thresher_loader(tiny_damage_pruned, tmp_path,
                                                                    stage, monkeypatch):
    path, counts = tiny_damage_pruned
    out = tmp_path / "q"
    quantize_model(path, stage, CAL, out, show_progress=False)
    llm = LLM(out)
    assert expert_counts(llm) == counts
    if stage.method != "nf4":  # GPTQ-4 and AWQ-4 experts on the CPU int4 kernel
        assert all(layer.mlp.experts.cpu_packs for layer in llm.engine.runner.model.layers)
    fast = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]  # the CPU kernels where present
    fast_passes = [prompt_pass(llm, p + f) for p, f in zip(PROMPTS, fast, strict=True)]
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the dequantizing references, in fp32
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference_greedy(out, PROMPTS)
    assert_tracks_reference(llm, PROMPTS, fast, fast_passes)
