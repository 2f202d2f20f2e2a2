"""The tiny demo's NF4 artifact on the CPU kernels against the dequantizing reference: decode on
the C step's NF4 kernel (``cpu_nf4.c``), prompts on bitsandbytes' CPU NF4 kernel.

Both kernels run in bf16 (activations and absmax rounded), the reference in fp32 from the same
codes, so the two differ by bf16 rounding only; greedy continuations must agree token for token
and the prompt logits within a small fraction of their scale (their argmax agreeing except at
near-ties: one position of a 264-token prompt flipped when measured), except at tokens whose
top-k routing sits at a near-tie and goes to another expert (2 of those 264 tokens in layer 0).
"""

from __future__ import annotations

import pytest
import torch

from tests.serve_kernels.conftest import assert_logits_track, prompt_pass, routed_pass
from thresher.compress.api import quantize_model
from thresher.formats.nf4 import concat_rows
from thresher.recipe import NF4Stage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.kernels import cpu_nf4
from thresher.serve_kernels.modeling import linear as linear_module
from thresher.serve_kernels.modeling import native_step
from thresher.serve_kernels.modeling.linear import NF4Linear
from thresher.serve_kernels.modeling.moe import ExpertLoop

PROMPTS = [[5, 17, 300, 42, 9, 77], [1023, 4000, 12, 3, 250], [61, 8, 99, 1500, 31, 7, 2, 640]]

requires_kernel = pytest.mark.skipif(not cpu_nf4.cpu_nf4_available(),
                                     reason="bitsandbytes' CPU NF4 kernel needs AVX512-BF16")


@pytest.fixture(scope="module")
def nf4_llm(tiny_demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("nf4") / "q"
    quantize_model(tiny_demo, NF4Stage(double_quant=True), None, out, show_progress=False)
    return LLM(out, max_model_len=256, dtype="float32")


@requires_kernel
def test_every_nf4_layer_takes_the_fast_path(nf4_llm):
    model = nf4_llm.engine.runner.model
    loops = [m for m in model.modules() if isinstance(m, ExpertLoop)]
    assert len(loops) == len(model.layers) and all(loop.cpu_packs for loop in loops)
    inside = {id(m) for loop in loops for m in loop.modules()}
    dense = [m for m in model.modules() if isinstance(m, NF4Linear) and id(m) not in inside]
    assert dense and all(m.cpu_pack is not None for m in dense)
    gate_up = loops[0].cpu_gate_up[0]  # gate and up of an expert in one pack
    assert gate_up.out_features == 2 * loops[0].gate[0].out_features
    # the reference's gate and up read the pack's published bytes, not a second copy
    storage = gate_up.published.untyped_storage().data_ptr()
    assert loops[0].up[0].nf4.packed.untyped_storage().data_ptr() == storage


@requires_kernel
def test_greedy_tokens_and_logits_match_reference(nf4_llm, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    step = nf4_llm.engine.runner.model.native_step
    calls = step.calls
    fast = [o.token_ids for o in nf4_llm.generate(PROMPTS, params)]
    assert step.calls - calls >= 23  # every decode step on the C step
    monkeypatch.setenv(native_step.ENV, "off")  # prompts on bitsandbytes' kernel (hooks see routing)
    fast_short = prompt_pass(nf4_llm, PROMPTS[2])
    long_prompt = (PROMPTS[0] * 50)[: cpu_nf4.DEQUANTIZE_ROWS + 8]  # the dequantizing branch
    fast_long = prompt_pass(nf4_llm, long_prompt)
    monkeypatch.setenv("THRESHER_KERNELS", "torch")
    assert [o.token_ids for o in nf4_llm.generate(PROMPTS, params)] == fast
    for got, ids in ((fast_short, PROMPTS[2]), (fast_long, long_prompt)):
        ref = routed_pass(nf4_llm, ids)
        assert_logits_track(got, ref)  # a token routed elsewhere at a near-tie is exempt
        assert (got[0].argmax(-1) == ref[0].argmax(-1)).float().mean() > 0.95  # near-ties flip


@requires_kernel
def test_pack_matches_reference_and_refuses_odd_shapes():
    from thresher.compress.nf4 import nf4_quantize
    from thresher.serve_kernels.kernels.nf4 import nf4_matmul_ref

    w = nf4_quantize(torch.randn(96, 192, generator=torch.Generator().manual_seed(0)), True,
                     torch.float32)
    pack = cpu_nf4.pack_nf4_cpu(w)
    for rows in (1, 7, cpu_nf4.dequantize_rows(96 * 192) + 1, cpu_nf4.DEQUANTIZE_ROWS):
        x = torch.randn(rows, 192)
        ref = nf4_matmul_ref(x, w)
        assert (cpu_nf4.nf4_cpu_matmul(x, pack) - ref).abs().max() < 0.01 * ref.abs().max()
    assert cpu_nf4.pack_nf4_cpu(nf4_quantize(torch.randn(40, 192), False, torch.float32)) is None


def test_concat_rows_is_exact():
    from thresher.compress.nf4 import nf4_quantize

    parts = [nf4_quantize(torch.randn(n, 128), True, torch.float32) for n in (64, 32)]
    merged = concat_rows(parts)
    assert merged.shape == (96, 128)
    assert torch.equal(merged.dequantize_fp32(), torch.cat([p.dequantize_fp32() for p in parts]))
    odd = [nf4_quantize(torch.randn(8, 100), False, torch.float32) for _ in range(2)]
    assert concat_rows(odd) is None  # 64-element blocks straddle rows of 100


def test_without_the_kernel_nf4_runs_the_reference_arithmetic(tiny_demo, tmp_path, monkeypatch):
    """A CPU without AVX512-BF16 (the probe answering no): nothing is converted for bitsandbytes'
    kernel, prompts run the reference's fp32 arithmetic with W from thresher's C pass (the
    reference's logits, up to the fp32 sums' order), and decoding runs in the C step."""
    out = tmp_path / "q"
    quantize_model(tiny_demo, NF4Stage(), None, out, show_progress=False)
    monkeypatch.setattr(cpu_nf4, "cpu_nf4_available", lambda: False)
    monkeypatch.setenv("THRESHER_CPU_DENSE_MAX", "0")  # every NF4 matrix stays NF4
    llm = LLM(out, max_model_len=64, dtype="float32")
    model = llm.engine.runner.model
    assert not any(getattr(m, "cpu_packs", None) for m in model.modules())
    calls = []
    fp32_matmul = linear_module.nf4_fp32_matmul
    monkeypatch.setattr(linear_module, "nf4_fp32_matmul",
                        lambda x, w: calls.append(x.shape[0]) or fp32_matmul(x, w))
    monkeypatch.setenv(native_step.ENV, "off")
    got = prompt_pass(llm, PROMPTS[2])
    assert calls  # the C pass served the prompt's NF4 matrices
    monkeypatch.setenv("THRESHER_KERNELS", "torch")
    ref = prompt_pass(llm, PROMPTS[2])
    assert torch.equal(got[1], ref[1])  # the same experts for every token
    assert (got[0] - ref[0]).abs().max() < 1e-4 * ref[0].abs().max()
    monkeypatch.delenv("THRESHER_KERNELS")
    monkeypatch.delenv(native_step.ENV)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    steps = model.native_step.calls
    assert len(llm.generate(PROMPTS[:1], params)[0].token_ids) == 8
    assert model.native_step.calls - steps >= 7  # decode on the C step's own NF4 kernel
