"""The one-call CPU decode step (``cpu_step.c``) against the operator path it replaces: final
hidden states of decode tokens at c=1 and c=3 across block boundaries, per family and format;
which models and batches take it; its dense matmul against torch's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import CALIBRATION_FILE, build_random_model
from tests.serve_kernels.conftest import save_family
from thresher.compress.api import quantize_model
from thresher.compress.nf4 import nf4_quantize
from thresher.formats.nf4 import NF4Weight
from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
from thresher.serve_kernels import LLM, SamplingParams
from thresher.serve_kernels.engine.model_runner import FLATTEN_MAX, ModelRunner
from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.engine.sequence import Sequence
from thresher.serve_kernels.kernels import cpu_native, cpu_step
from thresher.serve_kernels.kernels.cpu_nf4 import cpu_nf4_available, nf4_cpu_matmul, pack_nf4_cpu
from thresher.serve_kernels.modeling import native_step
from thresher.serve_kernels.modeling.native_step import NativeStep

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)
PROMPTS = [[5, 17, 300, 42, 9, 77, 1023], [8, 99, 150], [12, 3, 250, 61, 7, 2, 640, 31, 4, 40]]
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "llama", "qwen2", "qwen3",
            "glm4_moe", "deepseek_v3", "ernie4_5_moe", "gpt_oss", "qwen3_5_moe"]
STAGES = {"gptq4": QuantizeStage(method="rtn", group_size=32),
          "awq4": QuantizeStage(method="awq", group_size=32),
          "gptq8": QuantizeStage(method="rtn", bits=8, group_size=32),
          "nf4": QuantizeStage(method="nf4", compute_dtype="float32")}


@pytest.fixture(autouse=True)
def _library():
    if cpu_native.library() is None:
        pytest.skip("thresher's C kernels do not build here")


def _model_dir(family: str, fmt: str, root: Path, tokenizer: Path) -> Path:
    kw = {"olmoe": {"clip_qkv": 0.5},
          "deepseek_v3": {"q_lora_rank": 64, "kv_lora_rank": 64},  # q_b on cpu_q4: k % 64 == 0
          "gpt_oss": {"swiglu_limit": 0.1}}.get(family, {})  # the clamps bind on random weights
    hf = build_random_model(family, vocab_size=4096, intermediate_size=64, **kw)
    save_family(hf, tokenizer, root / "bf16")
    if fmt == "bf16":
        return root / "bf16"
    quantize_model(root / "bf16", STAGES[fmt], CAL, root / fmt, show_progress=False)
    return root / fmt


def _mixers(llm: LLM) -> list:
    from thresher.serve_kernels.modeling.deltanet import GatedDeltaNet

    return [m for m in llm.engine.runner.model.modules() if isinstance(m, GatedDeltaNet)]


def _recurrent_states(llm: LLM) -> list[torch.Tensor]:
    """Copies of every Gated DeltaNet's conv and delta-rule states."""
    return [t.float().clone() for m in _mixers(llm) for t in (m.conv_state, m.delta_state)]


def _restore(llm: LLM, states: list[torch.Tensor]) -> None:
    it = iter(states)
    for m in _mixers(llm):
        m.conv_state.copy_(next(it))
        m.delta_state.copy_(next(it))


def _decode_pairs(llm: LLM, prompts: list[list[int]], steps: int, monkeypatch
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill the prompts together, then ``steps`` decode steps of all of them; each step's
    final hidden states through the C step and through the operator path (same cache state)."""
    engine = llm.engine
    extra = [100 + 7 * i for i in range(steps)]
    seqs = [Sequence(f"s{i}", p + extra, SamplingParams(max_tokens=1), 1)
            for i, p in enumerate(prompts)]
    for seq in seqs:
        assert engine.block_manager.allocate(seq, seq.num_tokens)
    pairs = []
    try:
        engine.runner.hidden_states(ScheduledBatch(seqs, [len(p) for p in prompts]))
        for s in range(steps):
            for seq, p in zip(seqs, prompts, strict=True):
                seq.num_computed_tokens = len(p) + s
            batch = ScheduledBatch(seqs, [1] * len(seqs))
            states = _recurrent_states(llm)  # a recurrent layer's step advances its state
            monkeypatch.delenv(native_step.ENV, raising=False)
            fast, _ = engine.runner.hidden_states(batch)
            advanced = _recurrent_states(llm)
            _restore(llm, states)
            monkeypatch.setenv(native_step.ENV, "off")
            ref, _ = engine.runner.hidden_states(batch)
            for a, b in zip(advanced, _recurrent_states(llm), strict=True):  # the same states
                assert (a - b).abs().max() <= 2e-2 * b.abs().max() + 1e-6
            pairs.append((fast, ref))
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)
    return pairs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["bf16", "gptq4", "awq4", "gptq8", "nf4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_step_matches_operator_path(family, fmt, dtype, tmp_path, monkeypatch,
                                           tiny_demo):
    if fmt != "bf16" and family not in ("qwen3_moe", "qwen2_moe", "llama", "deepseek_v3",
                                        "gpt_oss"):
        pytest.skip("quantized formats on one family of each kind of MLP, shared expert and "
                    "attention")
    path = _model_dir(family, fmt, tmp_path, tiny_demo)
    monkeypatch.setenv("THRESHER_CPU_DENSE_MAX", "0")  # quantized matrices on the C kernels
    llm = LLM(path, block_size=4, dtype=dtype, max_num_seqs=4)
    step = llm.engine.runner.model.native_step
    assert isinstance(step, NativeStep)
    kinds = {L.qkv.kind for L in step.layers} | {L.gate_up[0].kind for L in step.layers}
    assert (cpu_step.LIN_Q4 in kinds) == (fmt in ("gptq4", "awq4"))  # on cpu_q4's packs
    assert (cpu_step.LIN_Q8 in kinds) == (fmt == "gptq8")  # on cpu_q4.c's 8-bit kernel
    assert (cpu_step.LIN_NF4 in kinds) == (fmt == "nf4")  # on cpu_nf4.c
    # fp32: the same roundings, sums in another order (measured 5e-7); bf16: one bf16 step of
    # the largest value where a sum's order flips a rounding (measured up to 1.3%); NF4, bf16
    # inside in either dtype: bitsandbytes' kernel on the operator path sums in lower precision
    # than cpu_nf4.c (test_nf4_matmul_is_closer_than_bitsandbytes), measured up to 2.2%, and a
    # decode token whose top-k sits at a near-tie may go to another expert in one of the two
    # (measured: gpt-oss, router logits 0.005 apart, that token's state moved 26%), so with NF4
    # one token row of a prompt set's decode steps may leave the tolerance
    tol = 4e-2 if fmt == "nf4" else 1e-5 if dtype == "float32" else 2e-2
    for prompts in (PROMPTS[:1], PROMPTS):  # c=1, then c=3 (contexts cross blocks of 4)
        errors = []
        for fast, ref in _decode_pairs(llm, prompts, 3, monkeypatch):
            scale = ref.float().abs().max()
            errors += ((fast.float() - ref.float()).abs().amax(-1) / scale).tolist()
        assert sum(e > tol for e in errors) <= (1 if fmt == "nf4" else 0), errors
    model = llm.engine.runner.model  # the LM head in C against torch's, on the same states
    assert step.table.lm_head.kind != cpu_step.LIN_NONE
    head = model.logits(fast)
    monkeypatch.setenv(native_step.ENV, "off")
    torch_head = model.logits(fast)
    assert (head - torch_head).abs().max() <= tol * torch_head.abs().max()
    assert step.calls == 7  # the prompts (chunks of at most FLATTEN_MAX) and every decode step


def test_native_step_is_not_built_when_off_or_unsupported(tmp_path, monkeypatch, tiny_demo):
    path = _model_dir("qwen3_moe", "bf16", tmp_path, tiny_demo)
    monkeypatch.setenv(native_step.ENV, "off")
    assert LLM(path, block_size=4).engine.runner.model.native_step is None
    monkeypatch.delenv(native_step.ENV)
    assert LLM(path, block_size=4, dtype="float16").engine.runner.model.native_step is None
    assert LLM(path, block_size=4).engine.runner.model.native_step is not None


def _nf4_weight(n: int, k: int, double_quant: bool
                ) -> tuple[NF4Weight, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random NF4 weight, its absmax in bf16 per row (what cpu_nf4.c reads), its published codes
    and the float64 W = map[code] * that absmax."""
    w = nf4_quantize(torch.randn(n, k), double_quant, torch.bfloat16)
    absmax = w.absmax_fp32().float().to(torch.bfloat16).reshape(n, k // w.blocksize)
    packed = w.packed.reshape(-1)
    codes = torch.stack([packed >> 4, packed & 0xF], 1).reshape(-1).long()
    scale = absmax.float().reshape(-1).repeat_interleave(w.blocksize)
    return w, absmax, packed, (w.quant_map.float()[codes] * scale).double().view(n, k)


@pytest.mark.parametrize("m,n,k,double_quant", [(1, 64, 256, False), (5, 37, 512, True),
                                                 (16, 130, 1024, False)])
def test_nf4_matmul_matches_bf16_reference(m, n, k, double_quant):
    """cpu_nf4.c against its definition: bf16 activations times weights map[code] * absmax (the
    absmax in bf16), summed in float64 here; a row's bits alone equal its bits in the batch."""
    w, absmax, packed, weight = _nf4_weight(n, k, double_quant)
    x = torch.randn(m, k)
    y = cpu_step.nf4_matmul(x, packed, absmax, w.quant_map, w.blocksize)
    ref = x.bfloat16().double() @ weight.T
    assert (y - ref).abs().max() <= 1e-6 * k ** 0.5 * ref.abs().max()
    assert torch.equal(cpu_step.nf4_matmul(x[-1:], packed, absmax, w.quant_map, w.blocksize),
                       y[-1:])
    with pytest.raises(ValueError, match="block size 48"):
        cpu_step.nf4_matmul(x, packed, absmax, w.quant_map, 48)


def test_nf4_matmul_is_closer_than_bitsandbytes():
    """Rounded to bf16 (the operator path's output dtype), cpu_nf4.c's outputs are the exact
    products' roundings but near ties; bitsandbytes' CPU kernel, on the same bf16 inputs,
    misses them by more (measured 1.4-1.5x the rounding's own error, three seeds, two shapes)."""
    if not cpu_nf4_available():
        pytest.skip("bitsandbytes has no CPU NF4 kernel here (needs AVX512-BF16)")
    w, absmax, packed, weight = _nf4_weight(256, 1024, False)
    x = torch.randn(8, 1024).bfloat16()
    exact = x.double() @ weight.T
    ours = cpu_step.nf4_matmul(x.float(), packed, absmax, w.quant_map, w.blocksize)
    same = (ours.bfloat16().double() == exact.bfloat16().double()).float().mean()
    assert same > 0.99  # fp32 sums: a rounding flips only where the exact value is near a tie
    theirs = nf4_cpu_matmul(x, pack_nf4_cpu(w)).double()
    rounding = (exact.bfloat16().double() - exact).abs().mean()
    assert (theirs - exact).abs().mean() > 1.2 * rounding


def test_prefill_keeps_operator_path_and_greedy_tokens_agree(tmp_path, monkeypatch, tiny_demo):
    path = _model_dir("qwen3_moe", "bf16", tmp_path, tiny_demo)
    llm = LLM(path, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long = [p * 7 for p in PROMPTS]  # longer than FLATTEN_MAX: a prefill on the operator path
    assert min(map(len, long)) > FLATTEN_MAX
    uploads = []  # host lists turned into tensors: the prefill's, not the decode steps'
    upload = ModelRunner._upload
    monkeypatch.setattr(ModelRunner, "_upload",
                        lambda self, *lists: uploads.append(len(lists[0])) or upload(self, *lists))
    first = [o.token_ids for o in llm.generate(long, params)]
    assert llm.engine.runner.model.native_step.calls == 3  # decode steps; not the prefill
    assert sum(uploads) == sum(map(len, long))
    llm.generate(PROMPTS, params)  # chunks of at most FLATTEN_MAX tokens run as decode tokens
    assert llm.engine.runner.model.native_step.calls == 3 + 4
    monkeypatch.setenv(native_step.ENV, "off")
    assert [o.token_ids for o in llm.generate(long, params)] == first


@pytest.mark.parametrize("family,fmt,dtype", [
    ("qwen3_moe", "bf16", "bfloat16"), ("qwen3_moe", "bf16", "float32"),
    ("qwen3_moe", "gptq4", "bfloat16"), ("deepseek_v3", "bf16", "bfloat16"),
    ("glm4_moe", "bf16", "bfloat16"), ("gpt_oss", "bf16", "bfloat16")])
def test_a_verify_chunk_is_bitwise_its_decode_steps(family, fmt, dtype, tmp_path, tiny_demo):
    """A chunk of 1 + k tokens (a speculative verify chunk) runs through the C step as decode
    tokens of one sequence, and its hidden states are bit for bit those of k + 1 single-token
    steps: greedy output under speculation is plain decoding's even in bf16 near-ties."""
    llm = LLM(_model_dir(family, fmt, tmp_path, tiny_demo), block_size=4, dtype=dtype)
    engine, step = llm.engine, llm.engine.runner.model.native_step
    prompt, chunk = PROMPTS[2], [33, 901, 7, 4000, 12, 250]
    hidden = []
    for split in ([len(chunk)], [1] * len(chunk)):
        seq = Sequence("v", prompt + chunk, SamplingParams(max_tokens=1), 1)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        try:
            engine.runner.hidden_states(ScheduledBatch([seq], [len(prompt)]))
            seq.num_computed_tokens = len(prompt)
            calls, outs = step.calls, []
            for n in split:
                outs.append(engine.runner.hidden_states(ScheduledBatch([seq], [n]))[0])
                seq.num_computed_tokens += n
            assert step.calls - calls == len(split)  # every chunk through the C step
            hidden.append(torch.cat(outs))
        finally:
            engine.block_manager.free(seq)
    assert torch.equal(hidden[0], hidden[1])


@pytest.fixture(params=[True, False], ids=["amx", "vector"])
def amx(request):
    """Each bf16 matmul test on the matrix units (where the CPU has them) and on the vector units."""
    if request.param and not cpu_step.amx(True):
        pytest.skip("no AMX tiles on this CPU (or Linux refused them)")
    cpu_step.amx(request.param)
    yield request.param
    cpu_step.amx(True)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bf16_values", [False, True])
@pytest.mark.parametrize("k", [1024, 1000, 520])
def test_dense_matmul_rows_do_not_depend_on_the_batch(wdtype, bf16_values, k, amx):
    """A row's output is the same bits alone (vdpbf16ps for a bf16-exact row of a bf16 matrix,
    or the AMX tiles) and inside batches of every size (the tiles; more than one tile of 16
    tokens), tails included."""
    w, rows = torch.randn(37, k).to(wdtype), torch.randn(40, k)
    if bf16_values:
        rows = rows.to(torch.bfloat16).float()
    alone = cpu_step.dense_matmul(rows[-1:], w)
    for m in (2, 3, 4, 5, 9, 16, 17, 40):
        assert torch.equal(cpu_step.dense_matmul(rows[-m:], w)[-1:], alone), m


@pytest.mark.parametrize("bf16_values", [False, True])  # True: AMX or vdpbf16ps where there
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 37, 1024), (1, 6, 1000), (3, 64, 1000), (16, 130, 96),
                                   (40, 48, 64), (1, 1031, 128), (5, 1031, 136)])
def test_dense_matmul_matches_torch(wdtype, m, n, k, bf16_values, amx):
    """Small matrices on one thread; 1,031 rows split over the threads (each thread's rows in
    streams, one last group of the rest)."""
    x, w = torch.randn(m, k), torch.randn(n, k).to(wdtype)
    if bf16_values:
        x = x.to(torch.bfloat16).float()
    torch.testing.assert_close(cpu_step.dense_matmul(x, w), x @ w.float().T, atol=1e-4, rtol=1e-4)


def test_amx_runs_where_the_cpu_has_it():
    """On a CPU with AMX-BF16 tiles the bf16 matmuls use them (the benchmarks' speed rests on it)."""
    if not {"amx_bf16", "amx_tile"} <= cpu_native._cpu_flags():
        pytest.skip("this CPU has no AMX-BF16")
    if os.environ.get(cpu_native.ENV, "native") != "native":
        pytest.skip(f"the kernels are built for {cpu_native.ENV}'s -march, not this CPU's")
    assert cpu_step.amx()
