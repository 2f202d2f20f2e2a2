"""gpt-oss in the engine: sinks and sliding-window layers over the paged cache, the biased MoE
with its clamped SwiGLU; logits and greedy decoding as transformers (base, pruned) and as the
dequantizing loader (4-bit) give them, over prompts longer than the window and blocks of 4."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import CALIBRATION_FILE, build_random_model
from tests.serve_kernels.conftest import prompt_logits, save_family
from tests.serve_kernels.kernels.helpers import rel_err
from thresher.compress.api import quantize_model
from thresher.models import load_model
from thresher.models.quantized import load_quantized_model
from thresher.prune.api import prune_model
from thresher.recipe import CalibrationConfig, FilesSource, PruneStage, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.modeling.gpt_oss import GptOssMoE, SinkAttention

PROMPT = [5, 17, 300, 42, 9, 77, 1023, 4000, 12, 3, 250, 61, 8, 99, 1500, 31, 7, 2, 640]
CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_demo):
    hf = build_random_model("gpt_oss", vocab_size=4096, num_layers=4)
    return hf, save_family(hf, tiny_demo, tmp_path_factory.mktemp("gpt_oss") / "base")


def _check(path, reference):
    llm = LLM(path, block_size=4, dtype="float32")
    model = llm.engine.runner.model
    assert [layer.attn.window for layer in model.layers] == [4, None, 4, None]
    assert all(isinstance(layer.attn, SinkAttention) and isinstance(layer.mlp, GptOssMoE)
               for layer in model.layers)
    assert not model.graph_safe
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(llm, PROMPT), expected, atol=1e-4, rtol=1e-4)
    gen = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                             eos_token_id=None)[0, len(PROMPT):].tolist()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].token_ids == gen


def test_base_matches_transformers(base):
    hf, path = base
    _check(path, hf)


def test_pruned_matches_transformers(base, tmp_path):
    _, path = base
    out = tmp_path / "pruned"
    prune_model(path, PruneStage(method="reap", ratio=0.5), CAL, out, show_progress=False)
    _check(out, load_model(out))


@pytest.mark.parametrize("method", ["gptq", "awq", "nf4"])
def test_four_bit_matches_the_dequantizing_loader(base, tmp_path, method, monkeypatch):
    _, path = base
    out = tmp_path / method
    quantize_model(path, QuantizeStage(method=method, group_size=32), CAL, out,
                   show_progress=False)
    reference = load_quantized_model(out)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    # the CPU 4-bit kernels compute in bf16: 1e-2 for two layers in test_families, here four
    fast = prompt_logits(LLM(out, block_size=4, dtype="float32"), PROMPT)
    assert rel_err(fast, expected) < 2e-2
    monkeypatch.setenv("THRESHER_KERNELS", "torch")  # the dequantizing references, in fp32
    _check(out, reference)


def test_mxfp4_checkpoint_serves_dequantized(base, tmp_path, tiny_demo):
    """The hub's MXFP4 layout: the engine dequantizes the experts as it loads them."""
    from tests.models.test_gpt_oss import _write_mxfp4

    _, path = base
    _write_mxfp4(path, tmp_path / "mxfp4")
    for f in tiny_demo.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "mxfp4" / f.name)
    _check(tmp_path / "mxfp4", load_model(tmp_path / "mxfp4"))


def test_gpu_path_in_tritons_interpreter_matches_the_cpu_path(base, monkeypatch):
    """The GPU path (Triton's rotary and norms through its interpreter; sinks and windows in
    PyTorch on every device) gives the CPU path's greedy tokens past the window."""
    _, path = base
    llm = LLM(path, block_size=4, dtype="float32", num_kv_blocks=32, max_model_len=64,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([PROMPT[:9]], params)[0].token_ids
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THRESHER_KERNELS", "triton")
    assert llm.generate([PROMPT[:9]], params)[0].token_ids == expected
