"""configs/gpt-oss-20b.yaml against gpt-oss-20b's own shapes (MXFP4 experts on the hub): its config.json (the hub's values,
written here; `check` reads no weights) in a local directory stands in for the download."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests.flows.recipe_check import check_against
from thresher.cli import app

RECIPE = Path(__file__).parents[2] / "configs" / "gpt-oss-20b.yaml"
# openai/gpt-oss-20b's config.json: the shapes and routing `thresher check` reads
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096,
                                            "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}}


def _check(tmp_path, **quantize) -> tuple[int, str]:
    return check_against(RECIPE, GPT_OSS_20B, tmp_path / "gpt-oss-20b", **quantize)


def test_the_recipe_fits_gpt_oss_20bs_shapes(tmp_path):
    code, out = _check(tmp_path)
    assert code == 0, out
    assert f"shapes checked against {tmp_path / 'gpt-oss-20b' / 'config.json'}" in out
    assert "prune reap ratio=0.25" in out and "quantize gptq 4-bit g64" in out


def test_groups_of_128_are_refused_with_the_dense_layers_width(tmp_path):
    code, out = _check(tmp_path, group_size=128)
    assert code == 2 and "does not divide the 2880 inputs of model.layers.0.self_attn.q_proj" in out
    assert "group_size 64 divides every layer's input size" in " ".join(out.split())


def test_the_committed_recipe_is_valid_without_the_download():
    result = CliRunner().invoke(app, ["check", str(RECIPE)])
    assert result.exit_code == 0, result.output
    assert "openai/gpt-oss-20b" in result.output
