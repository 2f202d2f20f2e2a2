"""AWQ below 4 bits on the trained tiny demo: written in the GPTQ format, reloaded by the
dequantizing loader and served by the engine with the logits the driver computed; clipping lowers
the output error it searches on real activations."""

import json

import pytest
import torch

from tests.serve_kernels.conftest import prompt_logits
from thresher.compress.api import quantize_model
from thresher.compress.awq import search_clip
from thresher.compress.rtn import rtn_quantize
from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity
from thresher.models import get_adapter, load_model
from thresher.models.quantized import load_quantized_model
from thresher.quant.grid import GridSpec
from thresher.recipe import CalibrationConfig, PerplexityConfig, QuantizeStage
from thresher.serve_kernels import LLM

CAL = CalibrationConfig(samples=8, seq_len=256)
PROMPT = [5, 17, 300, 42, 9, 77, 1023, 4000, 12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640]


@pytest.mark.slow
def test_awq3_artifact_loads_in_the_loader_and_the_engine(tiny_demo, tiny_tokenizer, tmp_path):
    states = {}
    report = quantize_model(tiny_demo, QuantizeStage(method="awq", bits=3, group_size=64), CAL,
                            tmp_path / "awq3", show_progress=False,
                            observer=lambda i, layer, q: states.__setitem__(
                                i, {k: v.clone() for k, v in layer.state_dict().items()}))
    qc = json.loads((tmp_path / "awq3" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 3 and qc["sym"] is False
    assert report.format == "gptq"
    in_memory = load_model(tiny_demo)
    for i, s in states.items():
        get_adapter(in_memory.config).layers(in_memory)[i].load_state_dict(s)
    loaded = load_quantized_model(tmp_path / "awq3")
    windows = eval_windows(tiny_tokenizer, PerplexityConfig(max_windows=8))
    disk = perplexity(loaded, windows, show_progress=False).perplexity
    assert disk == pytest.approx(perplexity(in_memory, windows, show_progress=False).perplexity,
                                 rel=1e-4)
    float_ppl = perplexity(load_model(tiny_demo), windows, show_progress=False).perplexity
    assert disk < 1.05 * float_ppl
    llm = LLM(tmp_path / "awq3", block_size=4, dtype="float32")
    assert llm.engine.model_info["format"] == "gptq"
    with torch.no_grad():
        expected = loaded(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=2e-4, rtol=2e-4)


def test_clip_lowers_the_partial_output_error_on_real_activations(tiny_demo, tiny_tokenizer):
    """o_proj of a trained layer and its real inputs: the searched ranges never raise any (row,
    group)'s error on the sampled tokens (shrink 0 is a candidate) and lower the total."""
    model = load_model(tiny_demo)
    o_proj = model.model.layers[1].self_attn.o_proj
    seen = []
    handle = o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    windows = eval_windows(tiny_tokenizer, PerplexityConfig(max_windows=2))
    with torch.no_grad():
        model(windows[:2])
    handle.remove()
    x = torch.cat(seen).reshape(-1, o_proj.in_features)[:512]
    w = o_proj.weight.detach()
    spec, gs = GridSpec(3, sym=False), 64
    max_val = search_clip(w, x, spec, gs)
    clipped = torch.clamp(w.reshape(w.shape[0], -1, gs), -max_val.unsqueeze(2),
                          max_val.unsqueeze(2)).reshape(w.shape)

    def errors(q: torch.Tensor) -> torch.Tensor:  # [rows, groups]
        d = (q - w).reshape(w.shape[0], 1, -1, gs)
        return (d * x.reshape(1, x.shape[0], -1, gs)).sum(-1).pow(2).mean(1)

    plain = errors(rtn_quantize(w, spec, gs).dequantize())
    clip = errors(rtn_quantize(clipped, spec, gs).dequantize())
    assert (clip <= plain * (1 + 1e-5)).all()
    assert clip.sum() < 0.9 * plain.sum()


def test_experts_calibrated_on_all_tokens_never_fall_back(tiny_demo):
    from thresher.compress.api import quantize_in_memory

    cal = CalibrationConfig(samples=1, seq_len=32)  # 32 tokens: some experts see fewer than 8
    stage = QuantizeStage(method="gptq", bits=4, group_size=64, min_expert_tokens=8)
    _, routed = quantize_in_memory(tiny_demo, stage, cal)
    _, every = quantize_in_memory(tiny_demo, stage.model_copy(update={"expert_tokens": "all"}), cal)
    assert any(r.fallback_experts for r in routed)
    assert not any(r.fallback_experts for r in every)
    assert all(t == 32 for r in every for t in r.expert_tokens.values())


def test_gptq_counts_routed_tokens_once_unless_gate_weighted(tiny_demo):
    """Counted once (the default at 4 bits), an expert's effective tokens are its routed tokens:
    whole numbers summing to tokens x top-k in every layer; gate-weighted, Kish's count is lower
    for some expert, and the weights GPTQ fits differ. ``auto`` gates at 2 bits only."""
    from thresher.compress.api import quantize_in_memory
    from thresher.compress.methods.gptq import GPTQMethod

    assert [GPTQMethod(QuantizeStage(method="gptq", bits=b)).gated for b in (2, 3, 4)] == [
        True, False, False]

    cal = CalibrationConfig(samples=1, seq_len=64)
    stage = QuantizeStage(method="gptq", bits=4, group_size=64, min_expert_tokens=0)
    model_once, once = quantize_in_memory(tiny_demo, stage, cal)
    model_gate, gated = quantize_in_memory(
        tiny_demo, stage.model_copy(update={"expert_weighting": "gate"}), cal)
    top_k = load_model(tiny_demo).config.num_experts_per_tok
    for a, b in zip(once, gated, strict=True):
        assert all(float(n).is_integer() for n in a.expert_tokens.values())
        assert sum(a.expert_tokens.values()) == 64 * top_k
        assert all(b.expert_tokens[e] <= n + 1e-3 for e, n in a.expert_tokens.items())
        assert any(b.expert_tokens[e] < n - 1 for e, n in a.expert_tokens.items())
    expert = "model.layers.0.mlp.experts"
    w_once = {k: v for k, v in model_once.state_dict().items() if k.startswith(expert)}
    w_gate = {k: v for k, v in model_gate.state_dict().items() if k.startswith(expert)}
    assert w_once and any(not torch.equal(w_once[k], w_gate[k]) for k in w_once)


@pytest.mark.slow
def test_heldout_selection_runs_and_changes_the_artifact(tiny_demo):
    """``select_on: heldout`` fits on the even calibration batches and chooses on the odd: the
    alphas and weights differ from ``fit``; with one batch there is nothing to hold out and the
    layer is fitted and judged on all of it."""
    from thresher.compress.api import quantize_in_memory
    from thresher.compress.methods.awq import _split

    stage = QuantizeStage(method="awq", bits=3, group_size=64)
    heldout = stage.model_copy(update={"select_on": "heldout"})
    two = CalibrationConfig(samples=16, seq_len=32)  # two batches of 8
    fit_model, fit = quantize_in_memory(tiny_demo, stage, two)
    held_model, held = quantize_in_memory(tiny_demo, heldout, two)
    assert [r.awq_alpha.keys() for r in fit] == [r.awq_alpha.keys() for r in held]
    assert any(a.awq_alpha != b.awq_alpha for a, b in zip(fit, held, strict=True))
    fit_sd, held_sd = fit_model.state_dict(), held_model.state_dict()
    changed = [k for k in fit_sd if not torch.equal(fit_sd[k], held_sd[k])]
    assert any("experts" in k for k in changed) and any("self_attn" in k for k in changed)
    xs = [torch.randn(8, 32, 16)]  # one batch: fitted and judged on all of it
    (fit_xs, _), (held_xs, _) = _split(xs, [None], heldout=True)
    assert fit_xs is xs and held_xs is xs
    (fit_xs, _), (held_xs, _) = _split(xs * 3, [None] * 3, heldout=True)
    assert (len(fit_xs), len(held_xs)) == (2, 1)


def test_heldout_check_undoes_clipping_that_only_fits_the_search_tokens():
    """With the search tokens as their own check nothing changes; on other tokens every kept
    shrink is no worse than the unclipped range there."""
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[:, 0] = 8
    x, other = torch.randn(64, 64), torch.randn(64, 64) * torch.linspace(0.1, 3, 64)
    spec, gs = GridSpec(3, sym=False), 32
    plain = search_clip(w, x, spec, gs)
    assert torch.equal(search_clip(w, x, spec, gs, check=x), plain)
    checked = search_clip(w, x, spec, gs, check=other)
    org = w.abs().reshape(16, 2, gs).amax(-1)
    undone = (checked == org) & (plain != org)
    assert undone.any() and ((checked == plain) | undone).all()

    def errors(m: torch.Tensor) -> torch.Tensor:  # [rows, groups] on the check tokens
        c = torch.clamp(w.reshape(16, 2, gs), -m.unsqueeze(2), m.unsqueeze(2)).reshape(16, 64)
        d = (rtn_quantize(c, spec, gs).dequantize() - w).reshape(16, 1, 2, gs)
        return (d * other.reshape(1, -1, 2, gs)).sum(-1).pow(2).mean(1)

    assert (errors(checked) <= errors(org) * (1 + 1e-5)).all()
