"""configs/glm45-air.yaml against GLM-4.5-Air's own shapes: its config.json (the hub's values,
written here; `check` reads no weights) in a local directory stands in for the download."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests.flows.recipe_check import check_against
from thresher.cli import app

RECIPE = Path(__file__).parents[2] / "configs" / "glm45-air.yaml"
# zai-org/GLM-4.5-Air's config.json: the shapes and routing `thresher check` reads
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
    "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1,
    "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "use_qk_norm": False,
    "vocab_size": 151552, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]}


def _check(tmp_path, **quantize) -> tuple[int, str]:
    return check_against(RECIPE, GLM45_AIR, tmp_path / "GLM-4.5-Air", **quantize)


def test_the_recipe_fits_glm45_airs_shapes(tmp_path):
    code, out = _check(tmp_path)
    assert code == 0, out
    assert f"shapes checked against {tmp_path / 'GLM-4.5-Air' / 'config.json'}" in out
    assert "prune reap ratio=0.25" in out and "quantize gptq 4-bit g64" in out


def test_groups_of_128_are_refused_with_the_dense_layers_width(tmp_path):
    code, out = _check(tmp_path, group_size=128)
    assert code == 2 and "does not divide the 10944 inputs of model.layers.0.mlp.down_proj" in out


def test_the_committed_recipe_is_valid_without_the_download():
    result = CliRunner().invoke(app, ["check", str(RECIPE)])
    assert result.exit_code == 0, result.output
    assert "zai-org/GLM-4.5-Air" in result.output
