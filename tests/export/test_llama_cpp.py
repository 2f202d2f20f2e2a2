"""Exported GGUF files in the real runtime, llama.cpp (llama-cpp-python, the optional ``llama``
extra): its quantizers against thresher's, and its perplexity and greedy text on the tiny demo
against thresher's evaluation of the same weights."""

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.export.conftest import CAL
from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity
from thresher.export import compute_importance, dequantize_gguf, export_gguf
from thresher.export.block_quants import quantize
from thresher.export.llama_runtime import (
    INSTALL_HINT,
    LLAMA_CPP_AVAILABLE,
    LlamaCppModel,
    amx_build,
)
from thresher.models.checkpoint import CheckpointReader
from thresher.models.loading import load_model, load_tokenizer
from thresher.recipe import CalibrationConfig, PerplexityConfig

pytestmark = pytest.mark.skipif(not LLAMA_CPP_AVAILABLE, reason=INSTALL_HINT)

QType = gguf.GGMLQuantizationType
EVAL = PerplexityConfig(seq_len=128, max_windows=4)


@pytest.fixture(scope="module")
def ggml():
    """llama.cpp's own block quantizer, ggml_quantize_chunk, from the library the wheel ships."""
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]

    def run(weights: np.ndarray, qtype: QType, importance: np.ndarray | None) -> np.ndarray:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        out = np.zeros((weights.shape[0], weights.shape[1] // block * size), dtype=np.uint8)
        imp = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
        lib.ggml_quantize_chunk(int(qtype), weights.ctypes.data, out.ctypes.data, 0,
                                weights.shape[0], weights.shape[1],
                                None if imp is None else imp.ctypes.data)
        return out
    return run


@pytest.fixture(scope="module")
def windows(tiny_demo):
    return eval_windows(load_tokenizer(tiny_demo), EVAL)


@pytest.fixture(scope="module")
def expert_rows(tiny_demo) -> np.ndarray:
    """The tiny demo's trained expert up projections as rows of 256 (one K-quant super-block)."""
    reader = CheckpointReader(tiny_demo)
    return np.concatenate([
        reader.get(f"model.layers.{i}.mlp.experts.{e}.up_proj.weight").float().numpy()
        .reshape(-1, 256) for i in range(4) for e in range(8)])


IMPORTANCE = np.random.default_rng(0).gamma(0.5, size=256).astype(np.float32)  # heavy-tailed


@pytest.mark.parametrize("qtype", [QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q4_0,
                                   QType.Q4_1, QType.Q5_0, QType.Q5_1])
@pytest.mark.parametrize("weighted", [False, True])
def test_quantizers_match_llama_cpp(expert_rows, ggml, qtype, weighted):
    """On the trained expert weights, thresher's blocks are llama.cpp's: the same value for
    >98% of weights (the rest differ by float summation order in a near-tie of the scale
    search) and the same squared error to 0.1%."""
    weights = expert_rows
    importance = IMPORTANCE if weighted else None
    ours = gguf.quants.dequantize(quantize(weights, qtype, importance), qtype)
    theirs = gguf.quants.dequantize(ggml(weights, qtype, importance), qtype)
    assert (ours == theirs).mean() > 0.98
    ratio = ((ours - weights) ** 2).mean() / ((theirs - weights) ** 2).mean()
    assert abs(ratio - 1) < 1e-3, ratio


@pytest.mark.parametrize("qtype", [QType.Q3_K, QType.Q4_K, QType.Q4_1, QType.Q4_0])
def test_importance_lowers_the_weighted_error_as_in_llama_cpp(expert_rows, ggml, qtype):
    """sum_j imp_j * (w_j - q_j)^2 is lower with the importance matrix than without, in
    llama.cpp's quantizer and in thresher's by the same factor (to 1%)."""
    def weighted_error(quantizer, importance):
        got = gguf.quants.dequantize(quantizer(expert_rows, qtype, importance), qtype)
        return float((IMPORTANCE * (got - expert_rows) ** 2).sum())

    ours = weighted_error(quantize, IMPORTANCE) / weighted_error(quantize, None)
    theirs = weighted_error(ggml, IMPORTANCE) / weighted_error(ggml, None)
    assert ours < 0.9 and theirs < 0.9, (ours, theirs)
    assert ours == pytest.approx(theirs, rel=0.01)


def _thresher_next_tokens(model, prompt: list[int], continuation: list[int]) -> list[int]:
    """thresher's greedy choice after ``prompt`` and each prefix of ``continuation``."""
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return logits.argmax(-1).tolist()


def _compare(gguf_path, reference_dir, windows) -> tuple[float, float, float]:
    """llama.cpp's perplexity of the file, thresher's of ``reference_dir``, and the fraction of
    llama.cpp's 16 greedy tokens after 2 prompts that thresher picks too, given the same prefix
    (so one near-tie, which llama.cpp's 8-bit activations may break the other way, costs one
    token and not the rest of the text)."""
    model = load_model(reference_dir)
    ours = perplexity(model, windows, show_progress=False).perplexity
    llama = LlamaCppModel(gguf_path, n_ctx=EVAL.seq_len)
    try:
        theirs = perplexity(llama.logits, windows, show_progress=False).perplexity
        agree = []
        for row in windows[:2]:
            prompt = row[:32].tolist()
            text = llama.greedy(prompt, 16)[0]
            agree += [a == b for a, b in zip(text, _thresher_next_tokens(model, prompt, text),
                                             strict=True)]
    finally:
        llama.close()
    return theirs, ours, float(np.mean(agree))


def test_models_load_without_extra_buffer_types(tmp_path, tiny_demo):
    """LlamaCppModel turns llama.cpp's extra CPU buffer types off where it has AMX code (which
    crashes when built with GCC 12, docs/gguf.md), keeps them on (repacking) otherwise, and leaves
    llama-cpp-python's defaults as they were."""
    import llama_cpp

    export_gguf(tiny_demo, tmp_path / "m.gguf", "q4_0", show_progress=False)
    llama = LlamaCppModel(tmp_path / "m.gguf", n_ctx=16)
    try:
        assert llama.llm.model_params.use_extra_bufts is not amx_build()
        assert llama.logits(torch.tensor([[3, 396, 325, 2789]])).isfinite().all()
    finally:
        llama.close()
    assert llama_cpp.llama_model_default_params().use_extra_bufts is True


@pytest.mark.slow
@pytest.mark.parametrize(("gguf_type", "imatrix"), [
    ("f16", False), ("q8_0", False), ("q4_0", False), ("q4_1", False), ("q6_k", False),
    ("q4_k_m", False), ("q4_k_m", True), ("q4_0", True)])
def test_llama_cpp_runs_the_exported_weights(tiny_demo, windows, tmp_path, gguf_type, imatrix):
    """llama.cpp's perplexity equals thresher's on the GGUF's own (dequantized) weights to 0.5%
    and its greedy text agrees; F16 and Q8_0 are also within 0.5% of the source model."""
    importance = compute_importance(tiny_demo, CAL, show_progress=False) if imatrix else None
    out = tmp_path / "m.gguf"
    export_gguf(tiny_demo, out, gguf_type, importance=importance, show_progress=False)
    same = dequantize_gguf(out, tiny_demo, tmp_path / "same")
    theirs, ours, agree = _compare(out, same, windows)
    assert theirs == pytest.approx(ours, rel=0.005)
    assert agree >= 0.9, agree
    if gguf_type in ("f16", "q8_0"):
        base = perplexity(load_model(tiny_demo), windows, show_progress=False).perplexity
        assert theirs == pytest.approx(base, rel=0.005)


@pytest.mark.slow
@pytest.mark.parametrize(("gguf_type", "imatrix"), [("q3_k", False), ("q3_k_m", True)])
def test_llama_cpp_runs_q3_k_on_small(small_demo, tmp_path, gguf_type, imatrix):
    """The small demo (hidden 256, so its attention and expert gate/up matrices are whole Q3_K
    super-blocks): llama.cpp's perplexity of the 3-bit file equals thresher's evaluation of the
    file's dequantized weights to 0.5%, and its greedy text agrees."""
    importance = compute_importance(small_demo, CAL, show_progress=False) if imatrix else None
    out = tmp_path / "m.gguf"
    result = export_gguf(small_demo, out, gguf_type, importance=importance, show_progress=False)
    assert result.types["blk.0.attn_q.weight"] == result.types["blk.0.ffn_up_exps.weight"] == "Q3_K"
    same = dequantize_gguf(out, small_demo, tmp_path / "same")
    windows = eval_windows(load_tokenizer(small_demo), EVAL)
    theirs, ours, agree = _compare(out, same, windows)
    assert theirs == pytest.approx(ours, rel=0.005)
    assert agree >= 0.9, agree
    source = perplexity(load_model(small_demo), windows, show_progress=False).perplexity
    assert theirs < 1.2 * source  # 3 bits do not cost everything
    if not imatrix:  # and plain rounding costs something (the importance-weighted Q3_K_M mix
        assert source < theirs  # scored 0.08% under the source on these 4 windows: level)


@pytest.mark.slow
def test_llama_cpp_runs_a_reap_pruned_model(tiny_demo, windows, tmp_path):
    from thresher.prune.api import prune_model
    from thresher.recipe import PruneStage

    pruned = tmp_path / "pruned"
    prune_model(tiny_demo, PruneStage(method="reap", keep=4), CalibrationConfig(samples=4, seq_len=64),
                pruned, show_progress=False)
    export_gguf(pruned, tmp_path / "p.gguf", "q8_0", show_progress=False)
    theirs, ours, agree = _compare(tmp_path / "p.gguf", pruned, windows)
    assert theirs == pytest.approx(ours, rel=0.005)
    assert agree >= 0.9, agree


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_lossless_q4_1_matches_the_quantized_artifact(packed, windows, tmp_path, method):
    """The hand-off file in llama.cpp scores the GPTQ/AWQ artifact's perplexity (thresher's
    dequantizing loader) to 0.5%, and writes the same greedy text."""
    export_gguf(packed / method, tmp_path / "q.gguf", "q4_1", show_progress=False)
    theirs, ours, agree = _compare(tmp_path / "q.gguf", packed / method, windows)
    assert theirs == pytest.approx(ours, rel=0.005)
    assert agree >= 0.9, agree


FAMILY_CONFIGS = {
    "qwen3_moe": {}, "qwen2_moe": {"norm_topk_prob": False}, "mixtral": {},
    "olmoe": {"norm_topk_prob": False, "num_key_value_heads": 4}, "llama": {}, "qwen3": {},
    "qwen2": {}, "glm4_moe": {}, "deepseek_v3": {}, "ernie4_5_moe": {}}


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_every_family_computes_the_same_logits_in_llama_cpp(tiny_tokenizer, tmp_path, family):
    """F32 export of a random model of each family: llama.cpp's logits are thresher's to float
    rounding (mean |diff| under 1e-4, about 2e-5 measured; llama with unpermuted q/k rows is off
    by 1.3e-3), so the architecture mapping, the rotary layout and the routing agree with
    llama.cpp's graphs. A near-tie in a random router may pick another expert for a token, so
    the mean and not the maximum is bounded."""
    from tests.conftest import build_random_model
    from thresher.models import save_model

    model = build_random_model(family, vocab_size=len(tiny_tokenizer), **FAMILY_CONFIGS[family])
    save_model(model, tiny_tokenizer, tmp_path / family)
    export_gguf(tmp_path / family, tmp_path / "f.gguf", "f32", show_progress=False)
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    llama = LlamaCppModel(tmp_path / "f.gguf", n_ctx=32)
    try:
        got = llama.logits(ids)
    finally:
        llama.close()
    assert (got - want).abs().mean() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("family", [*FAMILY_CONFIGS, "gpt_oss"])
def test_every_family_computes_the_dequantized_logits_in_llama_cpp(tiny_tokenizer, tmp_path,
                                                                    family, gguf_type):
    """8- and 4-bit exports of a random model of each family: llama.cpp's logits are thresher's
    on the file's own weights (``dequantize_gguf``) to within llama.cpp's rounding of the
    activations: it multiplies these types against activations quantized to 8 bits per block of
    32 (a step of max|x| / 127), about 0.5% of a logit's spread here whatever the weight type
    (measured 0.4-0.8%, against 0.02% for F32 files); the bound is 2%. Random logits are close
    together, so argmax ties break both ways and only most of them must agree."""
    from tests.conftest import build_random_model
    from thresher.models import save_model

    model = build_random_model(family, vocab_size=len(tiny_tokenizer),
                               **FAMILY_CONFIGS.get(family, {}))
    save_model(model, tiny_tokenizer, tmp_path / family)
    export_gguf(tmp_path / family, tmp_path / "q.gguf", gguf_type, show_progress=False)
    same = dequantize_gguf(tmp_path / "q.gguf", tmp_path / family, tmp_path / "same")
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_model(same)(input_ids=ids).logits
    llama = LlamaCppModel(tmp_path / "q.gguf", n_ctx=32)
    try:
        got = llama.logits(ids)
    finally:
        llama.close()
    assert (got - want).abs().mean() < 0.02 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


# Each file type thresher writes, as llama.cpp's quantizer names it.
LLAMA_FTYPES = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_0": "Q5_0", "q4_1": "Q4_1", "q4_0": "Q4_0",
                "q4_k": "Q4_K_S", "q4_k_m": "Q4_K_M", "q3_k": "Q3_K_S", "q3_k_m": "Q3_K_M"}


@pytest.fixture(scope="module")
def type_models(tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """F32 GGUF files of two random Qwen3-MoEs: untied with 4 experts, 16 layers and rows of
    256 (expert down rows of 32 fall back); tied with 8 experts (llama.cpp's Mixtral rules) and
    rows of 128, so every K-quant falls back."""
    from tests.conftest import build_random_model
    from thresher.models import save_model

    root = tmp_path_factory.mktemp("types")
    shapes = {"untied": dict(num_layers=16, hidden_size=256, head_dim=32, num_attention_heads=8,
                             num_experts=4, tie_word_embeddings=False),
              "tied": dict(num_layers=4, hidden_size=128, head_dim=32, num_attention_heads=4,
                           num_experts=8, tie_word_embeddings=True)}
    for name, shape in shapes.items():
        model = build_random_model("qwen3_moe", vocab_size=len(tiny_tokenizer), **shape)
        save_model(model, tiny_tokenizer, root / name)
        export_gguf(root / name, root / f"{name}.f32.gguf", "f32", show_progress=False)
    return root


def _llama_quantize(source: Path, out: Path, ftype: str, imatrix: bool = False
                    ) -> dict[str, str]:
    """llama.cpp's quantizer on ``source``; ``imatrix`` hands it an (empty) importance matrix,
    which is all its type choice asks of one."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    entries = (llama_cpp.llama_model_imatrix_data * 1)()  # only the terminating entry
    if imatrix:
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["untied", "tied"])
def test_tensor_types_are_llama_cpps(type_models, tmp_path, model):
    """For every file type, each tensor's type is the one llama.cpp's own quantizer gives the
    same model's F32 file: an untied model's embeddings at the base type and its head at Q6_K
    (a tied model's shared matrix at Q6_K), the K-quant mixes, an 8-expert model's attn_v and
    attn_k at Q8_0, the fallbacks of rows that are not whole super-blocks, and with an importance
    matrix Q4_0's and Q5_0's first ffn_down layers."""
    runs = [(t, f, False) for t, f in LLAMA_FTYPES.items()] + [("q4_0", "Q4_0", True),
                                                                ("q5_0", "Q5_0", True)]
    importance = None
    for gguf_type, ftype, imatrix in runs:
        name = f"{gguf_type}{'-imatrix' if imatrix else ''}"
        theirs = _llama_quantize(type_models / f"{model}.f32.gguf", tmp_path / f"l-{name}.gguf",
                                 ftype, imatrix)
        if imatrix and importance is None:
            importance = compute_importance(type_models / model, CAL, show_progress=False)
        ours = export_gguf(type_models / model, tmp_path / f"{name}.gguf", gguf_type,
                           importance=importance if imatrix else None, show_progress=False).types
        assert ours == theirs, (name, {n: (t, theirs.get(n)) for n, t in ours.items()
                                       if theirs.get(n) != t})
        if model == "untied" and gguf_type == "q4_k_m":  # not Q6_K: only a tied one gets it
            assert ours["token_embd.weight"] == "Q4_K" and ours["output.weight"] == "Q6_K"
        if model == "untied" and imatrix:  # the first eighth of 16 layers
            assert [ours[f"blk.{i}.ffn_down_exps.weight"] for i in (0, 1, 2)] == \
                [{"q4_0": "Q4_1", "q5_0": "Q5_1"}[gguf_type]] * 2 + [ftype]
