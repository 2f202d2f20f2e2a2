"""configs/qwen35-moe.yaml against Qwen3.5-35B-A3B's own shapes: its multimodal config.json (the
hub's values for the language model, the vision tower's defaults; `check` reads no weights) in a
local directory stands in for the download."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from tests.flows.recipe_check import check_against
from thresher.cli import app

RECIPE = Path(__file__).parents[2] / "configs" / "qwen35-moe.yaml"
# Qwen/Qwen3.5-35B-A3B's config.json: the multimodal wrapper with the text model's shapes and
# routing, which `thresher check` reads
QWEN35_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False, "image_token_id": 248056, "video_token_id": 248057,
    "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_act": "silu", "hidden_size": 2048,
        "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_experts": 256, "num_experts_per_tok": 8, "vocab_size": 248320,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-06, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "tie_word_embeddings": False, "eos_token_id": 248044},
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152,
                      "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}}


def _check(tmp_path, **quantize) -> tuple[int, str]:
    return check_against(RECIPE, QWEN35_35B, tmp_path / "Qwen3.5-35B-A3B", **quantize)


def test_the_recipe_fits_qwen35s_shapes(tmp_path):
    code, out = _check(tmp_path)
    assert code == 0, out
    assert f"shapes checked against {tmp_path / 'Qwen3.5-35B-A3B' / 'config.json'}" in out
    assert "prune reap ratio=0.25" in out and "quantize gptq 4-bit g128" in out


def test_groups_that_do_not_divide_the_expert_widths_are_refused(tmp_path):
    code, out = _check(tmp_path, group_size=1024)
    assert code == 2 and "does not divide the 512 inputs of model.layers.0.mlp.shared_expert.down_proj" in out


def test_speculative_drafts_are_refused_for_the_recurrent_layers(tmp_path):
    """The engine cannot take back a recurrent state's rejected draft tokens: a recipe that
    scores variants as drafts of this base is refused by `check`, naming the field."""
    model = tmp_path / "Qwen3.5-35B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN35_35B))
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["model"] = str(model)
    recipe["validate"]["draft_of_base"] = True
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["check", str(tmp_path / "r.yaml")])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "validate.draft_of_base" in out and "Gated DeltaNet" in out


def test_the_committed_recipe_is_valid_without_the_download():
    result = CliRunner().invoke(app, ["check", str(RECIPE)])
    assert result.exit_code == 0, result.output
    assert "Qwen/Qwen3.5-35B-A3B" in result.output
