"""Mixed precision under a budget (``bits: auto``): the recipe's checks, the allocation, the
``dynamic`` rules, and an end-to-end run on the tiny demo model loaded by the dequantizing loader
and the serving engine."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import CALIBRATION_FILE
from thresher.compress.api import quantize_model
from thresher.compress.mixed import Allocation, Unit, allocate
from thresher.errors import CompressionError, RecipeError
from thresher.flows.sweep import parse_recipe
from thresher.formats.config import packed_format
from thresher.formats.gptq import dynamic_override, module_pattern, packed_bits
from thresher.models import get_adapter, load_model
from thresher.models.quantized import DequantLinear, load_quantized_model
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.kernels.cpu_int4 import Int4Pack
from thresher.serve_kernels.modeling.linear import GPTQLinear

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)
PROMPTS = [[5, 17, 300, 42, 9, 77], [1023, 4000, 12, 3, 250], [61, 8, 99, 1500, 31, 7, 2, 640]]


def recipe_with(quantize: dict) -> dict:
    return {"name": "r", "model": "demo:tiny",
            "variants": [{"name": "v", "stages": [{"quantize": quantize}]}]}


@pytest.mark.parametrize("quantize,message", [
    ({"method": "awq", "bits": "auto", "target_bits": 3},
     "variants.0.stages.0.quantize.bits: 'auto' (mixed precision under a budget) is supported"),
    ({"method": "gptq", "bits": "auto"}, "needs exactly one of target_bits and target_mb"),
    ({"method": "gptq", "bits": "auto", "target_bits": 3, "target_mb": 2}, "exactly one"),
    ({"method": "gptq", "bits": 4, "target_bits": 3}, "target_bits applies only with bits: auto"),
    ({"method": "gptq", "bits": "auto", "target_bits": 9}, "outside candidate_bits"),
    ({"method": "gptq", "bits": "auto", "target_bits": 3, "candidate_bits": [4]},
     "at least two different widths"),
    ({"method": "gptq", "bits": "auto", "target_bits": 3, "candidate_bits": [2, 5]},
     "variants.0.stages.0.quantize.candidate_bits.1"),
    ({"method": "rtn", "bits": 4, "target_bits": 3},
     "target_bits: unknown key for method rtn (it belongs to method gptq)"),
])
def test_recipe_refuses_bad_auto_options_naming_the_field(quantize, message):
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe_with(quantize))
    assert message in str(err.value)


def test_recipe_accepts_auto_and_names_the_variant():
    stage = QuantizeStage(method="gptq", bits="auto", target_bits=3.5)
    assert stage.describe() == "quantize gptq auto 3.5-bit g128"
    r = parse_recipe({"name": "r", "model": "demo:tiny", "sweep": {"quantize": {
        "method": "gptq", "bits": "auto", "target_bits": [2.5, 3.5]}}})
    assert [v.name for v in r.variants] == ["gptq-auto2.5", "gptq-auto3.5"]


def unit(name: str, scale: float, shape=(256, 256)) -> Unit:
    return Unit(name, [f"m.{name}"], [shape], damage={b: scale * 4.0**-b for b in (2, 3, 4, 8)})


def test_allocation_meets_the_budget_and_favours_the_sensitive_matrices():
    # Ten equal matrices, five 100x more sensitive than the others: at 3 bits on average the
    # sensitive ones get 4 bits and the others 2 (same damage curve shape, so certain).
    units = [unit(f"hot{i}", 100.0) for i in range(5)] + [unit(f"cold{i}", 1.0) for i in range(5)]
    budget = sum(u.cost(3, 128) for u in units)
    allocate(units, [2, 3, 4, 8], 128, budget)
    a = Allocation(units, 128, budget, "target_bits=3")
    assert a.used_bits <= budget
    assert a.average_bits == pytest.approx(3.0)
    assert all(u.bits == 4 for u in units[:5]) and all(u.bits == 2 for u in units[5:])


@pytest.mark.parametrize("target", [2.3, 2.5, 3.5, 5.0, 7.9])
def test_allocation_leaves_less_than_one_step_of_budget(target):
    torch.manual_seed(0)
    shapes = [(256, 256), (128, 256), (256, 128), (512, 256)]
    units = [Unit(f"u{i}", [f"m.u{i}"], [shapes[i % 4]],
                  damage={b: float(torch.rand(())) * 2.0**-b for b in (2, 3, 4, 8)})
             for i in range(40)]
    budget = sum(u.cost(target, 128) for u in units)
    allocate(units, [2, 3, 4, 8], 128, budget)
    used = sum(u.cost(u.bits, 128) for u in units)
    smallest_step = min(u.cost(b, 128) - u.cost(u.bits, 128)
                        for u in units for b in (3, 4, 8) if b > u.bits)
    assert used <= budget
    assert budget - used < smallest_step  # nothing more fits


def test_allocation_refuses_a_budget_below_the_narrowest_width():
    units = [unit("a", 1.0)]
    with pytest.raises(CompressionError, match="below their size at 2 bits"):
        allocate(units, [2, 4], 128, units[0].cost(1.5, 128))


def test_packed_bits_counts_codes_scales_zeros_and_g_idx():
    # [N=256, K=512] at 3 bits g128: codes, 4 groups x 256 (fp16 scale + 3-bit zero), g_idx
    assert packed_bits(256, 512, 3, 128) == 256 * 512 * 3 + 4 * 256 * 19 + 32 * 512


def test_dynamic_rules_follow_gptqmodel_and_vllm():
    dynamic = {
        "-:model\\.layers\\.1\\.mlp\\.experts\\.0\\..*": {},
        module_pattern(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                        "model.layers.0.self_attn.v_proj"]): {"bits": 8},
        "+:model\\.layers\\.1\\..*": {"bits": 2, "group_size": 64},
    }
    assert dynamic_override(dynamic, "model.layers.0.self_attn.k_proj") == {"bits": 8}
    assert dynamic_override(dynamic, "model.layers.0.self_attn.qkv_proj") == {"bits": 8}  # vLLM
    assert dynamic_override(dynamic, "model.layers.0.self_attn.o_proj") == {}
    assert dynamic_override(dynamic, "model.layers.10.self_attn.q_proj") == {}
    latent = {module_pattern(["model.layers.3.self_attn.q_a_proj",
                              "model.layers.3.self_attn.kv_a_proj_with_mqa"]): {"bits": 2}}
    for name in ("q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj"):  # vLLM's DeepSeek fusion
        assert dynamic_override(latent, f"model.layers.3.self_attn.{name}") == {"bits": 2}, name
    assert dynamic_override(dynamic, "model.layers.1.mlp.experts.0.up_proj") is None  # first wins
    config = type("C", (), {"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": dynamic}})()
    fmt = packed_format(config, "x")
    assert fmt.for_module("model.layers.0.self_attn.q_proj").bits == 8
    assert fmt.for_module("model.layers.1.mlp.experts.3.down_proj").group_size == 64
    assert fmt.for_module("model.layers.2.mlp.experts.3.down_proj").bits == 4
    assert fmt.for_module("model.layers.1.mlp.experts.0.down_proj") is None


@pytest.fixture(scope="module")
def auto_artifact(tiny_demo, tmp_path_factory):
    """bits auto at 3 bits on average (g64: the tiny model's down projections have 64 inputs),
    with the driver's in-memory layers kept to compare the artifact with."""
    out = tmp_path_factory.mktemp("mixed") / "q"
    stage = QuantizeStage(method="gptq", bits="auto", target_bits=3.0, group_size=64,
                          sensitivity="rtn")
    states = {}
    report = quantize_model(tiny_demo, stage, CAL, out, show_progress=False,
                            observer=lambda i, layer, q: states.__setitem__(
                                i, {k: v.clone() for k, v in layer.state_dict().items()}))
    return out, report, states


@pytest.mark.slow
def test_auto_hits_its_budget_and_writes_mixed_widths(auto_artifact):
    out, report, _ = auto_artifact
    a = report.allocation
    units = [Unit.from_dict(u) for u in a["units"]]
    budget = sum(u.cost(3.0, 64) for u in units)
    used = sum(u.cost(u.bits, 64) for u in units)
    assert used <= budget and budget - used < min(u.cost(3, 64) - u.cost(2, 64) for u in units)
    assert len(a["weight_share"]) >= 2  # widths really differ
    assert report.metrics()["average_bits"] == pytest.approx(a["average_bits"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == a["base_bits"] and qc["dynamic"]
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", framework="pt") as f:
        for u in units:
            for m, (n, k) in zip(u.modules, u.shapes, strict=True):
                assert f.get_slice(f"{m}.qweight").get_shape() == [k * u.bits // 32, n]
                want = u.bits if u.bits != qc["bits"] else None
                assert dynamic_override(qc["dynamic"], m).get("bits") == want


@pytest.mark.slow
def test_auto_artifact_loads_at_each_width_and_matches_the_driver(auto_artifact, tiny_demo):
    out, report, states = auto_artifact
    widths = {m: u["bits"] for u in report.allocation["units"] for m in u["modules"]}
    loaded = load_quantized_model(out)
    reference = load_model(tiny_demo)
    layers = get_adapter(reference.config).layers(reference)
    for i, s in states.items():
        layers[i].load_state_dict(s)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
    down = loaded.model.layers[0].mlp.experts.down
    for e in range(8):  # each module holds the packed codes of its own width
        assert isinstance(down[e], DequantLinear)
        bits = widths[f"model.layers.0.mlp.experts.{e}.down_proj"]
        assert down[e].packed()["qweight"].shape[0] == 64 * bits // 32


@pytest.mark.slow
def test_engine_greedy_tokens_match_the_dequantized_model(auto_artifact, monkeypatch):
    out, _, _ = auto_artifact
    # Both dequantize every matrix per step, so a few short continuations keep this quick.
    prompts = PROMPTS[:2]
    reference = load_quantized_model(out)
    want = [reference.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(out)
    gptq = [m for m in llm.engine.runner.model.modules() if isinstance(m, GPTQLinear)]
    assert {m.bits for m in gptq} >= {2, 4}
    for m in gptq:  # 4-bit modules keep the CPU int4 kernel, 2 and 3 bits dequantize
        assert isinstance(m.cpu_pack, Int4Pack) == (m.bits == 4)
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # fp32 everywhere: exact parity expected
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


@pytest.mark.slow
def test_auto_with_a_size_target_fills_the_checkpoint_size(auto_artifact, tiny_demo, tmp_path):
    _, report, _ = auto_artifact
    target = round(report.artifact_mb, 3)
    stage = QuantizeStage(method="gptq", bits="auto", target_mb=target, group_size=64,
                          sensitivity="rtn")
    sized = quantize_model(tiny_demo, stage, CAL, tmp_path / "q", show_progress=False)
    units = [Unit.from_dict(u) for u in sized.allocation["units"]]
    step = max(u.cost(8, 64) - u.cost(2, 64) for u in units) / 8 / 2**20
    header = 0.05  # safetensors headers and the index are outside the tensor budget
    assert target - step < sized.artifact_mb <= target + header
    assert sized.allocation["quantized_mb"] <= sized.allocation["budget_mb"]
