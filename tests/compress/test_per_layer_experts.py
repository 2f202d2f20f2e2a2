"""Quantizing a damage-budget checkpoint (per-layer expert counts) of the trained tiny demo model.

Every method writes an artifact that keeps ``layer_num_experts``, loads back with each MoE
layer's own expert count, and scores the perplexity of the in-memory quantized model the driver
committed layer by layer.
"""

import json
import json.decoder

import pytest

from thresher.compress.api import quantize_model
from thresher.data.windows import eval_windows
from thresher.evaluate.perplexity import perplexity
from thresher.models import get_adapter, load_model
from thresher.models.quantized import QuantizedExperts, load_quantized_model
from thresher.recipe import (
    CalibrationConfig,
    FilesSource,
    PerplexityConfig,
    QuantizeStage,
)

# a file outside this repository, so that editing thresher does not change the artifacts
CAL = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=8, seq_len=64)
GROUP = 64  # the tiny model's down projections have 64 inputs


@pytest.fixture(scope="module")
def windows(tiny_tokenizer):
    return eval_windows(tiny_tokenizer, PerplexityConfig(max_windows=4))


@pytest.fixture(scope="module")
def pruned_ppl(tiny_damage_pruned, windows):
    return perplexity(load_model(tiny_damage_pruned[0]), windows, show_progress=False).perplexity


@pytest.mark.parametrize("stage", [
    QuantizeStage(method="gptq", group_size=GROUP),
    QuantizeStage(method="awq", group_size=GROUP),
    QuantizeStage(method="rtn", group_size=GROUP),
    QuantizeStage(method="nf4", group_size=GROUP),
    QuantizeStage(method="gptq", bits="auto", target_bits=3.0, group_size=GROUP),
], ids=["gptq", "awq", "rtn", "nf4", "gptq-auto"])
def test_damage_budget_checkpoint_quantizes_reloads_and_evaluates(tiny_damage_pruned, windows,
                                                                  pruned_ppl, tmp_path, stage):
    path, counts = tiny_damage_pruned
    states = {}
    quantize_model(path, stage, CAL, tmp_path / "q", show_progress=False,
                   observer=lambda i, layer, q: states.__setitem__(
                       i, {k: v.clone() for k, v in layer.state_dict().items()}))
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["layer_num_experts"] == counts and "quantization_config" in config

    loaded = load_quantized_model(tmp_path / "q")
    adapter = get_adapter(loaded.config)
    for layer, n in zip(adapter.layers(loaded), counts, strict=True):
        experts = adapter.mlp(layer).experts
        assert isinstance(experts, QuantizedExperts) and experts.num_experts == n
        assert adapter.router(layer).weight.shape[0] == n

    in_memory = load_model(path)  # the pruned model with the driver's quantized layers
    for i, layer in enumerate(get_adapter(in_memory.config).layers(in_memory)):
        layer.load_state_dict(states[i])
    memory_ppl = perplexity(in_memory, windows, show_progress=False).perplexity
    disk_ppl = perplexity(loaded, windows, show_progress=False).perplexity
    assert disk_ppl == pytest.approx(memory_ppl, rel=1e-4)
    assert disk_ppl != pruned_ppl  # quantized
    assert abs(disk_ppl - pruned_ppl) < (0.3 if stage.bits == "auto" else 0.1) * pruned_ppl
