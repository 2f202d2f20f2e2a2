"""configs/ernie45-moe.yaml against ERNIE-4.5-21B-A3B's own shapes: its config.json (the hub's
values, written here; `check` reads no weights) in a local directory stands in for the download."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests.flows.recipe_check import check_against
from thresher.cli import app

RECIPE = Path(__file__).parents[2] / "configs" / "ernie45-moe.yaml"
# baidu/ERNIE-4.5-21B-A3B-PT's config.json: the shapes and routing `thresher check` reads
ERNIE45_21B = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288, "head_dim": 128,
    "max_position_embeddings": 131072, "num_attention_heads": 20, "num_key_value_heads": 4,
    "num_hidden_layers": 28, "rms_norm_eps": 1e-05, "rope_theta": 500000, "use_bias": False,
    "tie_word_embeddings": True, "vocab_size": 103424, "moe_num_experts": 64, "moe_k": 6,
    "moe_num_shared_experts": 2, "moe_intermediate_size": 1536, "moe_layer_start_index": 1,
    "moe_layer_end_index": 27, "moe_layer_interval": 1, "moe_norm_min": 1e-12,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _check(tmp_path, **quantize) -> tuple[int, str]:
    return check_against(RECIPE, ERNIE45_21B, tmp_path / "ERNIE-4.5-21B-A3B-PT", **quantize)


def test_the_recipe_fits_ernie45s_shapes(tmp_path):
    code, out = _check(tmp_path)
    assert code == 0, out
    assert f"shapes checked against {tmp_path / 'ERNIE-4.5-21B-A3B-PT' / 'config.json'}" in out
    assert "prune reap ratio=0.25" in out and "quantize gptq 4-bit g128" in out


def test_groups_that_do_not_divide_the_hidden_width_are_refused(tmp_path):
    code, out = _check(tmp_path, group_size=1024)
    assert code == 2 and "does not divide the 2560 inputs of model.layers.0.self_attn.q_proj" in out


def test_the_committed_recipe_is_valid_without_the_download():
    result = CliRunner().invoke(app, ["check", str(RECIPE)])
    assert result.exit_code == 0, result.output
    assert "baidu/ERNIE-4.5-21B-A3B-PT" in result.output
