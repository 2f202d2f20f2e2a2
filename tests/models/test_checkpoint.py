import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.conftest import build_random_model
from thresher.models import get_adapter, save_model
from thresher.models.checkpoint import (
    CheckpointReader,
    CheckpointWriter,
    canonical_layer_state,
    read_layer_state,
)
from thresher.models.random_init import DENSE_FAMILIES, MOE_FAMILIES


def _keys(path):
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            keys |= set(h.keys())
    return keys


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_save_reload_identical_logits(family, tmp_path):
    model = build_random_model(family)
    save_model(model, None, tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)


# gpt-oss keeps its experts fused on the hub too: tests/models/test_gpt_oss.py
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f != "gpt_oss"])
def test_saved_keys_are_hub_canonical(family, tmp_path):
    model = build_random_model(family)
    ad = get_adapter(model.config)
    save_model(model, None, tmp_path)
    keys = _keys(tmp_path)
    assert not any("gate_up_proj" in k for k in keys), "fused expert tensors must not be written"
    moe = next(i for i, layer in enumerate(ad.layers(model)) if ad.is_moe_layer(layer))
    for e in range(8):
        for proj in ("gate", "up", "down"):
            assert ad.disk_expert_key(moe, e, proj) + ".weight" in keys
    assert ad.disk_router_key(1) + ".weight" in keys
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    if family == "deepseek_v3":
        assert {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                "model.layers.1.self_attn.q_a_layernorm.weight",
                "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias"} <= keys
    if family == "glm4_moe":
        assert {"model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj"
                ".weight", "model.layers.1.mlp.gate.e_score_correction_bias"} <= keys


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_layer_state_round_trip(family, tmp_path):
    model = build_random_model(family)
    ad = get_adapter(model.config)
    save_model(model, None, tmp_path)
    reader = CheckpointReader(tmp_path)
    layer = ad.layers(model)[1]
    state = read_layer_state(reader, ad, 1, ad.num_experts(model.config))
    assert set(state) == set(layer.state_dict())
    for k, v in layer.state_dict().items():
        assert torch.equal(state[k], v), k
    canon = canonical_layer_state(ad, 1, layer.state_dict())
    assert set(canon) == {k for k in reader.tensor_names() if k.startswith("model.layers.1.")}


def test_writer_shards_and_indexes(tmp_path):
    model = build_random_model("qwen3_moe")
    ad = get_adapter(model.config)
    writer = CheckpointWriter(tmp_path, max_shard_bytes=50_000)
    for i, layer in enumerate(ad.layers(model)):
        writer.add(canonical_layer_state(ad, i, layer.state_dict()))
    writer.add({"model.embed_tokens.weight": model.model.embed_tokens.weight,
                "model.norm.weight": model.model.norm.weight, "lm_head.weight": model.lm_head.weight})
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    model.config.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_streamed_shards_read_back_exactly_in_every_dtype(tmp_path):
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=g).half(), "i32": torch.randint(-9, 9, (4, 3)),
        "u8": torch.randint(0, 255, (5,), dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "i64": torch.arange(6).reshape(2, 3), "empty": torch.empty(0, 4),
        "slice": torch.randn(6, 6, generator=g)[:, 1:4],  # non-contiguous input
    }
    writer = CheckpointWriter(tmp_path)
    writer.add(tensors)
    writer.close()
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(tensors) and not list(tmp_path.glob("*.data"))
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


# --- bad files: each is named, with what is wrong with it -------------------------------------


def _broken_copy(tiny_demo, tmp_path, fault: str):
    """A copy of demo:tiny whose model.safetensors has one fault."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / fault
    shutil.copytree(tiny_demo, out)
    weights = out / "model.safetensors"
    if fault == "corrupt":  # a header length no real file has (safetensors: "header too large")
        data = bytearray(weights.read_bytes())
        data[:8] = (10**12).to_bytes(8, "little")
        weights.write_bytes(bytes(data))
    elif fault == "truncated":  # a copy cut short
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) * 2 // 3])
    else:
        tensors = load_file(weights)
        key = "model.layers.0.self_attn.q_proj.weight"
        if fault == "misshapen":
            tensors[key] = tensors[key][:, :100].contiguous()
        else:  # "wrong-dtype"
            tensors[key] = tensors[key].to(torch.int32)
        save_file(tensors, weights, metadata={"format": "pt"})
    return out


FAULTS = {"corrupt": "corrupt safetensors header", "truncated": "truncated",
          "misshapen": "has shape [128, 100], config.json makes it [128, 128]",
          "wrong-dtype": "has dtype I32, not a floating-point dtype"}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_reader_names_the_bad_file_and_its_fault(fault, tiny_demo, tmp_path):
    from thresher.errors import CheckpointError
    from thresher.export import export_gguf
    from thresher.models import load_model
    from thresher.models.layerwise import LayerwiseModel
    from thresher.serve_kernels.loader import load_engine_model

    def export(path):
        return export_gguf(path, tmp_path / "out.gguf", "f16", show_progress=False)

    path = _broken_copy(tiny_demo, tmp_path, fault)
    for read in (LayerwiseModel, load_model, load_engine_model, export):
        with pytest.raises(CheckpointError) as err:
            read(path)
        message = str(err.value)
        assert message.startswith(f"{path / 'model.safetensors'}: "), (read, message)
        assert FAULTS[fault] in message and "\n" not in message
    assert not (tmp_path / "out.gguf").exists()


SIDE_FAULTS = {  # file, how it is broken, what the message says
    "config-not-object": ("config.json", "[1, 2]", "cannot read it (not a JSON object)"),
    "config-zero-size": ("config.json", None, "num_hidden_layers is -1; it must be positive"),
    "tokenizer-json": ("tokenizer.json", "{bad", "corrupt (Expecting property name"),
    "tokenizer-config": ("tokenizer_config.json", '{"a": "', "corrupt (Unterminated string"),
}


@pytest.mark.parametrize("fault", list(SIDE_FAULTS))
def test_a_bad_config_or_tokenizer_file_is_named(fault, tiny_demo, tmp_path):
    """config.json and the tokenizer's files: the file and its fault, from every reader that
    opens it (transformers' own errors name neither, or fail deep inside on a negative size)."""
    import shutil

    from thresher.errors import ModelError
    from thresher.export import export_gguf
    from thresher.models import load_model
    from thresher.models.layerwise import LayerwiseModel
    from thresher.models.loading import load_tokenizer
    from thresher.serve_kernels.loader import load_engine_model

    name, text, reason = SIDE_FAULTS[fault]
    path = tmp_path / fault
    shutil.copytree(tiny_demo, path)
    if text is None:
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, "num_hidden_layers": -1}))
    else:
        (path / name).write_text(text)
    readers = [lambda p: export_gguf(p, tmp_path / "out.gguf", "f16", show_progress=False)]
    if fault != "config-zero-size":  # the tokenizer reads config.json but not its sizes
        readers.append(load_tokenizer)
    if name == "config.json":
        readers += [LayerwiseModel, load_model, load_engine_model]
    for read in readers:
        with pytest.raises(ModelError) as err:
            read(path)
        message = str(err.value)
        assert message.startswith(f"{path / name}: ") and reason in message, (read, message)
    assert not (tmp_path / "out.gguf").exists()


def test_a_packed_weight_of_the_wrong_shape_is_named_by_the_engine_loader(tiny_demo, tmp_path):
    """A GPTQ module whose packed tensors hold another width than config.json's: the engine
    names the artifact and the module instead of failing in a kernel."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import CALIBRATION_FILE
    from thresher.compress.api import quantize_model
    from thresher.errors import ModelError
    from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage
    from thresher.serve_kernels.loader import load_engine_model

    out = tmp_path / "gptq"
    quantize_model(tiny_demo, QuantizeStage(method="rtn", bits=4, group_size=-1),
                   CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2,
                                     seq_len=16), out, show_progress=False)
    tensors = load_file(out / "model.safetensors")
    key = "model.layers.1.self_attn.o_proj"
    for name, width in (("qweight", 8), ("scales", 8), ("qzeros", 1)):  # 8 outputs, not 128
        tensors[f"{key}.{name}"] = tensors[f"{key}.{name}"][:, :width].contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"^{out}: {key}.qweight: shape \(16, 8\), but a gptq "
                                         r"\[128, 128\] weight at 4 bits has \(16, 128\)"):
        load_engine_model(out)


def test_a_quantized_checkpoint_given_to_a_stage_is_refused_by_name(tiny_demo, tmp_path):
    """Pruning or quantizing a GPTQ artifact (a published variant, say) says what it holds and
    what to give instead, before any layer is read (it was a state-dict traceback)."""
    from tests.conftest import CALIBRATION_FILE
    from thresher.compress.api import quantize_model
    from thresher.errors import ModelError
    from thresher.prune.api import prune_model
    from thresher.recipe import CalibrationConfig, FilesSource, PruneStage, QuantizeStage

    cal = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2, seq_len=16)
    stage = QuantizeStage(method="rtn", bits=4, group_size=-1)
    gptq = tmp_path / "gptq"
    quantize_model(tiny_demo, stage, cal, gptq, show_progress=False)
    refused = rf"^{gptq}: holds GPTQ 4-bit weights; .* give the model it was quantized from$"
    with pytest.raises(ModelError, match=refused):
        quantize_model(gptq, stage, cal, tmp_path / "again", show_progress=False)
    with pytest.raises(ModelError, match=refused):
        prune_model(gptq, PruneStage(method="reap", ratio=0.25), cal, tmp_path / "pruned")
    assert not (tmp_path / "again").exists() and not (tmp_path / "pruned").exists()


def test_quantizing_a_published_model_gives_one_that_loads(tiny_demo, tmp_path):
    """A published variant holds thresher.json (every file's hash) and its stage report: the
    quantized model made from it carries neither, so its own files are not checked against the
    input's manifest (it was refused by every loader: 'does not match its manifest')."""
    import shutil

    from tests.conftest import CALIBRATION_FILE
    from thresher.compress.api import quantize_model
    from thresher.formats.artifact import DEMO_MODEL_META, MANIFEST, PRUNE_REPORT
    from thresher.models import load_model
    from thresher.models.manifest import write_manifest
    from thresher.recipe import CalibrationConfig, FilesSource, QuantizeStage

    published = tmp_path / "published"
    shutil.copytree(tiny_demo, published)
    (published / PRUNE_REPORT).write_text("{}")
    write_manifest(published, variant="reap")
    out = tmp_path / "gptq"
    quantize_model(published, QuantizeStage(method="rtn", bits=4, group_size=-1),
                   CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=2,
                                     seq_len=16), out, show_progress=False)
    assert not {MANIFEST, PRUNE_REPORT, DEMO_MODEL_META} & {f.name for f in out.iterdir()}
    assert load_model(out) is not None


def _thresher(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: its own process, output not a terminal."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "thresher", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.parametrize(("fault", "command"), [
    ("corrupt", ["perplexity", "--max-windows", "1", "--seq-len", "16", "--model"]),
    ("truncated", ["quantize", "--method", "rtn", "--group-size", "-1", "--samples", "2",
                   "--seq-len", "16", "--out", "{out}", "--model"]),
    ("misshapen", ["serve", "--port", "9", "--max-num-seqs", "1"]),
])
def test_cli_prints_one_line_naming_the_file_and_exits_2(fault, command, tiny_demo, tmp_path):
    path = _broken_copy(tiny_demo, tmp_path, fault)
    result = _thresher(*[a.replace("{out}", str(tmp_path / "out")) for a in command], str(path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # not wrapped, no traceback
    assert lines[0].startswith(f"error: {path / 'model.safetensors'}: ")
    assert FAULTS[fault] in lines[0]
    assert not (tmp_path / "out").exists()
