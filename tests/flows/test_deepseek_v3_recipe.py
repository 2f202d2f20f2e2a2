"""configs/deepseek-v3.yaml against DeepSeek-V3's own shapes: its config.json (the hub's values
without the FP8 quantization_config, as the BF16 conversion writes it; `check` reads no weights)
in a local directory stands in for the download."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests.flows.recipe_check import check_against
from thresher.cli import app

RECIPE = Path(__file__).parents[2] / "configs" / "deepseek-v3.yaml"
# deepseek-ai/DeepSeek-V3's config.json: the shapes, routing and attention `thresher check` reads
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                          "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "vocab_size": 129280,
    "bos_token_id": 0, "eos_token_id": 1}


def _check(tmp_path, config=DEEPSEEK_V3, **quantize) -> tuple[int, str]:
    return check_against(RECIPE, config, tmp_path / "DeepSeek-V3", **quantize)


def test_the_recipe_fits_deepseek_v3s_shapes(tmp_path):
    code, out = _check(tmp_path)
    assert code == 0, out
    assert f"shapes checked against {tmp_path / 'DeepSeek-V3' / 'config.json'}" in out
    assert "prune reap ratio=0.25" in out and "quantize gptq 4-bit g128" in out


def test_a_group_size_that_splits_the_latent_is_refused(tmp_path):
    """g1024 divides neither the 512-wide kv latent nor the 1536-wide query rank."""
    code, out = _check(tmp_path, group_size=1024)
    assert code == 2 and "does not divide the 1536 inputs of model.layers.0.self_attn.q_b_proj" in out


def test_the_committed_recipe_is_valid_without_the_download():
    result = CliRunner().invoke(app, ["check", str(RECIPE)])
    assert result.exit_code == 0, result.output
    assert "deepseek-ai/DeepSeek-V3" in result.output


def test_the_hubs_fp8_weights_are_refused_before_any_compute(tmp_path):
    """The hub snapshot as it is (block-scaled FP8): `check` names the quantization_config
    rather than letting the run fail at its first load."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]}
    code, out = _check(tmp_path, {**DEEPSEEK_V3, "quantization_config": fp8})
    assert code == 2 and "model:" in out and "unsupported quantization_config" in out
    assert "'quant_method': 'fp8'" in out
