"""GGUF export of the tiny demo model: metadata, tokenizer, and every tensor read back through the
gguf package's reader and dequantizer against the checkpoint it came from."""

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from tests.conftest import build_random_model
from thresher.errors import ExportError
from thresher.export import export_gguf
from thresher.models import save_model
from thresher.models.checkpoint import CheckpointReader

# Block-quantization error bound, as a fraction of the largest |w| in each block of 32: half a
# step of the block's grid plus the fp16 rounding of the scale (and of Q4_1's minimum); Q4_0's
# grid reaches only 7/8 of the block's extreme on the opposite side, a full step of error there.
BLOCK_ERROR = {"q8_0": 0.5 / 127 + 0.001, "q4_0": 1 / 8 + 0.005, "q4_1": 0.5 * 2 / 15 + 0.005}


def _source_keys(name: str, num_experts: int) -> list[str]:
    """The checkpoint tensors behind a GGUF tensor, spelled out independently of the exporter."""
    flat = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
    if name in flat:
        return [flat[name]]
    _, layer, role, suffix = name.split(".")
    prefix = f"model.layers.{layer}."
    experts = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    if role in experts:
        return [f"{prefix}mlp.experts.{e}.{experts[role]}.weight" for e in range(num_experts)]
    return [prefix + {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate", "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj"}[role] + "." + suffix]


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def _check_tensors(path, model_dir, gguf_type: str) -> int:
    """Every tensor of the file equals its source weights to within its type's rounding;
    returns the number of tensors checked. A quantized file's matrices are ``gguf_type`` or,
    where llama.cpp's rules lift them (the output head, an 8-expert model's attn_v and attn_k;
    these rows are under 256, so Q8_0), Q8_0; test_llama_cpp checks which."""
    reader = gguf.GGUFReader(path)
    source = CheckpointReader(model_dir)
    arch = _field(reader, "general.architecture")
    experts = reader.fields.get(f"{arch}.expert_count")
    num_experts = 0 if experts is None else int(experts.contents())
    names = set()
    for t in reader.tensors:
        names.add(t.name)
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        keys = _source_keys(t.name, num_experts)
        slices = [got] if len(keys) == 1 else list(got)
        assert len(slices) == len(keys), t.name
        keep_f32 = got.ndim == 1 or t.name.endswith("ffn_gate_inp.weight")
        if keep_f32:
            assert t.tensor_type.name == "F32", t.name
        elif gguf_type in ("f32", "f16", "bf16"):
            assert t.tensor_type.name == gguf_type.upper(), t.name
        else:
            assert t.tensor_type.name in (gguf_type.upper(), "Q8_0"), t.name
        for got_slice, key in zip(slices, keys, strict=True):
            want = source.get(key).float()
            if t.name.endswith("ffn_gate_inp_shexp.weight"):  # [1, H] on disk, {H} in llama.cpp
                want = want.reshape(-1)
            assert got_slice.shape == tuple(want.shape), (t.name, key)
            want = want.numpy()
            if keep_f32 or gguf_type == "f32":
                np.testing.assert_array_equal(got_slice, want, err_msg=t.name)
            elif gguf_type == "f16":
                np.testing.assert_array_equal(got_slice, want.astype(np.float16).astype(np.float32))
            elif gguf_type == "bf16":
                rounded = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
                np.testing.assert_array_equal(got_slice, rounded, err_msg=t.name)
            else:
                err = np.abs(got_slice - want).reshape(-1, 32).max(axis=1)
                amax = np.abs(want).reshape(-1, 32).max(axis=1)
                bound = BLOCK_ERROR[t.tensor_type.name.lower()]
                assert (err <= bound * amax + 1e-7).all(), (t.name, key)
    expected = set(source.tensor_names())
    assert {k for n in names for k in _source_keys(n, num_experts)} == expected
    return len(names)


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
def test_every_type_round_trips_to_the_checkpoint(tiny_demo, tiny_tokenizer, tmp_path, gguf_type):
    out = tmp_path / f"tiny-{gguf_type}.gguf"
    result = export_gguf(tiny_demo, out, gguf_type, show_progress=False)
    config = json.loads((tiny_demo / "config.json").read_text())
    reader = gguf.GGUFReader(out)
    assert _field(reader, "general.architecture") == "qwen3moe"
    assert _field(reader, "qwen3moe.block_count") == config["num_hidden_layers"] == 4
    assert _field(reader, "qwen3moe.expert_count") == result.num_experts == 8
    assert _field(reader, "qwen3moe.expert_used_count") == config["num_experts_per_tok"]
    assert _field(reader, "qwen3moe.expert_feed_forward_length") == config["moe_intermediate_size"]
    assert _field(reader, "qwen3moe.attention.head_count_kv") == config["num_key_value_heads"]
    assert _field(reader, "qwen3moe.attention.key_length") == config["head_dim"]
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == config["vocab_size"] == len(tiny_tokenizer)
    assert all(tokens[i] == tiny_tokenizer.convert_ids_to_tokens(i) for i in range(0, 4096, 97))
    assert _field(reader, "tokenizer.ggml.token_type")[0] == gguf.TokenType.CONTROL
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tiny_tokenizer.eos_token_id
    assert len(_field(reader, "tokenizer.ggml.merges")) > 1000
    assert _check_tensors(out, tiny_demo, gguf_type) == result.tensors == 2 + 4 * 12


def test_reap_pruned_model_exports_with_its_expert_count(tiny_demo, tmp_path):
    from thresher.prune.api import prune_model
    from thresher.recipe import CalibrationConfig, PruneStage

    pruned = tmp_path / "pruned"
    prune_model(tiny_demo, PruneStage(method="reap", keep=4),
                CalibrationConfig(samples=4, seq_len=64), pruned, show_progress=False)
    out = tmp_path / "pruned.gguf"
    assert export_gguf(pruned, out, "q8_0", show_progress=False).num_experts == 4
    reader = gguf.GGUFReader(out)
    assert _field(reader, "qwen3moe.expert_count") == 4
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert tuple(gate.shape) == (128, 4)  # GGUF lists dimensions innermost first
    _check_tensors(out, pruned, "q8_0")


def test_untied_output_head_is_exported(tiny_tokenizer, tmp_path):
    model = build_random_model("qwen3_moe", vocab_size=len(tiny_tokenizer), num_experts=6)
    save_model(model, tiny_tokenizer, tmp_path / "untied")
    out = tmp_path / "untied.gguf"
    result = export_gguf(tmp_path / "untied", out, "q4_1", show_progress=False)
    assert result.num_experts == 6
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert "output.weight" in names and "blk.1.ffn_down_exps.weight" in names
    assert _check_tensors(out, tmp_path / "untied", "q4_1") == result.tensors == 3 + 2 * 12


@pytest.mark.parametrize(("family", "per_layer"), [("qwen3", 11), ("qwen2", 12)])
def test_dense_families_export(tiny_tokenizer, tmp_path, family, per_layer):
    """Qwen3 has q/k norms, Qwen2 q/k/v biases; both keep their dense MLP."""
    save_model(build_random_model(family, vocab_size=len(tiny_tokenizer)), tiny_tokenizer,
               tmp_path / "dense")
    out = tmp_path / "dense.gguf"
    result = export_gguf(tmp_path / "dense", out, "q8_0", show_progress=False)
    reader = gguf.GGUFReader(out)
    assert _field(reader, "general.architecture") == result.architecture == family
    assert _field(reader, f"{family}.feed_forward_length") == 64
    assert not any(key.startswith(f"{family}.expert") for key in reader.fields)
    assert _check_tensors(out, tmp_path / "dense", "q8_0") == result.tensors == 3 + 2 * per_layer


def test_qwen2_moe_exports_its_shared_expert_and_biases(tiny_tokenizer, tmp_path):
    save_model(build_random_model("qwen2_moe", vocab_size=len(tiny_tokenizer), norm_topk_prob=False),
               tiny_tokenizer, tmp_path / "qwen2moe")
    out = tmp_path / "qwen2moe.gguf"
    result = export_gguf(tmp_path / "qwen2moe", out, "q8_0", show_progress=False)
    reader = gguf.GGUFReader(out)
    assert _field(reader, "general.architecture") == result.architecture == "qwen2moe"
    assert _field(reader, "qwen2moe.expert_shared_feed_forward_length") == 64
    assert _field(reader, "qwen2moe.expert_feed_forward_length") == 32
    names = {t.name for t in reader.tensors}
    assert {"blk.1.attn_q.bias", "blk.1.ffn_gate_inp_shexp.weight", "blk.1.ffn_down_shexp.weight"} <= names
    assert _check_tensors(out, tmp_path / "qwen2moe", "q8_0") == result.tensors == 3 + 2 * 17

    save_model(build_random_model("qwen2_moe", num_layers=1, vocab_size=len(tiny_tokenizer),
                                  norm_topk_prob=True), tiny_tokenizer, tmp_path / "renorm")
    with pytest.raises(ExportError, match="does not renormalize the top-k"):
        export_gguf(tmp_path / "renorm", tmp_path / "r.gguf")


def _with_pre_tokenizer(tiny_demo, target, regex: str):
    """A copy of the tiny demo whose tokenizer splits with ``regex`` as Qwen2's tokenizers do
    (serialized by the tokenizers library itself)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    shutil.copytree(tiny_demo, target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save(str(target / "tokenizer.json"))
    return target


def test_qwen2_pre_tokenizer_is_named_for_llama_cpp(tiny_demo, tmp_path):
    from thresher.export.gguf import QWEN2_PRE_TOKENIZER_REGEX

    model = _with_pre_tokenizer(tiny_demo, tmp_path / "qwen2-tok", QWEN2_PRE_TOKENIZER_REGEX)
    export_gguf(model, tmp_path / "q.gguf", "f16", show_progress=False)
    assert _field(gguf.GGUFReader(tmp_path / "q.gguf"), "tokenizer.ggml.pre") == "qwen2"

    llama3 = QWEN2_PRE_TOKENIZER_REGEX.replace(r"\p{N}|", r"\p{N}{1,3}|")
    assert llama3 != QWEN2_PRE_TOKENIZER_REGEX
    model = _with_pre_tokenizer(tiny_demo, tmp_path / "llama3-tok", llama3)
    with pytest.raises(ExportError, match="GPT-2's or Qwen2's pre-tokenizer"):
        export_gguf(model, tmp_path / "l.gguf", "f16", show_progress=False)


def test_refuses_what_it_cannot_export(tiny_demo, tiny_tokenizer, tmp_path):
    save_model(build_random_model("qwen3_moe", num_layers=1, vocab_size=len(tiny_tokenizer),
                                  norm_topk_prob=False), tiny_tokenizer, tmp_path / "no-renorm")
    with pytest.raises(ExportError, match="renormalizes the top-k gate weights"):
        export_gguf(tmp_path / "no-renorm", tmp_path / "a.gguf")

    quantized = tmp_path / "gptq"
    shutil.copytree(tiny_demo, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="gptq 4-bit weights"):
        export_gguf(quantized, tmp_path / "b.gguf")

    save_model(build_random_model("qwen3_moe", num_layers=1, vocab_size=len(tiny_tokenizer),
                                  intermediate_size=48), tiny_tokenizer, tmp_path / "odd-rows")
    with pytest.raises(ExportError, match="rows of 48 values.*Q8_0 block"):
        export_gguf(tmp_path / "odd-rows", tmp_path / "a.gguf", "Q8_0")
    assert export_gguf(tmp_path / "odd-rows", tmp_path / "a.gguf", "BF16").type == "bf16"
    (tmp_path / "a.gguf").unlink()

    with pytest.raises(ExportError, match="q2_k.*choose one of"):
        export_gguf(tiny_demo, tmp_path / "c.gguf", "q2_k")
    (tmp_path / "d.gguf").write_bytes(b"")
    with pytest.raises(ExportError, match="already exists"):
        export_gguf(tiny_demo, tmp_path / "d.gguf")
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == ["d.gguf"]


def test_llama_family_rows_are_permuted_and_read_back(tiny_tokenizer, tmp_path):
    """Mixtral runs on llama.cpp's llama graph: q/k rows go to its rotary layout, and
    dequantize_gguf undoes that, so the file's weights come back equal to the checkpoint."""
    from thresher.export import dequantize_gguf

    save_model(build_random_model("mixtral", num_layers=1, vocab_size=len(tiny_tokenizer)),
               tiny_tokenizer, tmp_path / "mixtral")
    result = export_gguf(tmp_path / "mixtral", tmp_path / "m.gguf", "f32", show_progress=False)
    assert result.architecture == "llama" and result.num_experts == 8
    source = CheckpointReader(tmp_path / "mixtral")
    q = next(t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors if t.name == "blk.0.attn_q.weight")
    want = source.get("model.layers.0.self_attn.q_proj.weight").numpy()
    assert not np.array_equal(q.data, want) and np.array_equal(np.sort(q.data, 0), np.sort(want, 0))
    back = CheckpointReader(dequantize_gguf(tmp_path / "m.gguf", tmp_path / "mixtral", tmp_path / "b"))
    assert set(back.tensor_names()) == set(source.tensor_names()) - {"lm_head.weight"} | (
        {"lm_head.weight"} & set(source.tensor_names()))
    for key in source.tensor_names():
        np.testing.assert_array_equal(back.get(key).numpy(), source.get(key).numpy(), err_msg=key)

    save_model(build_random_model("olmoe", num_layers=1, vocab_size=len(tiny_tokenizer),
                                  norm_topk_prob=False), tiny_tokenizer, tmp_path / "olmoe")
    with pytest.raises(ExportError, match="as many k/v heads as q heads"):
        export_gguf(tmp_path / "olmoe", tmp_path / "o.gguf")


def test_damage_budget_checkpoint_is_refused_with_the_reason(tiny_damage_pruned, tmp_path):
    """llama.cpp holds one expert count per model; a damage-budget prune has one per layer."""
    path, _ = tiny_damage_pruned
    with pytest.raises(ExportError, match="different numbers of experts.*one expert count per model"):
        export_gguf(path, tmp_path / "a.gguf")
    assert not list(tmp_path.glob("*.gguf"))
