"""Random-init configs of every supported family, for tests, benchmarks and interop checks.

Small enough to build in a second; real enough to exercise each family's layout (Qwen2-MoE's
shared expert, Mixtral's block_sparse_moe names, OLMoE's full-width q/k norms, GLM-4.5's sigmoid
router with score correction and two expert groups, its dense first layer, shared expert, partial
rotary, q/k/v biases and q/k norms; DeepSeek-V3's multi-head latent attention with a query rank,
decoupled interleaved rotary under yarn scaling, on GLM's router layout; gpt-oss's biased router
and experts, attention sinks and sliding-window layers with a window shorter than the test
prompts, and YaRN rotary; ERNIE-4.5's softmax router with a selection bias, its dense first
layer, two shared experts' worth of always-on MLP and interleaved rotary; Qwen3.5-MoE's Gated
DeltaNet and gated full-attention layers alternating, with partial rotary, zero-centered norms and
a gated shared expert, built as the text model the hub's multimodal checkpoint carries).
"""

from __future__ import annotations

from transformers import AutoConfig

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3",
                "gpt_oss", "ernie4_5_moe", "qwen3_5_moe")
DENSE_FAMILIES = ("llama", "qwen2", "qwen3")


def random_config(model_type: str, hidden_size: int = 64, num_layers: int = 2,
                  num_experts: int = 8, top_k: int = 2, intermediate_size: int = 32,
                  vocab_size: int = 512, **overrides):
    """A small transformers config of ``model_type`` (any family thresher supports)."""
    kw: dict = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=intermediate_size * 2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    if model_type in ("qwen3_moe", "qwen3"):
        kw["head_dim"] = hidden_size // 4
    if model_type == "mixtral":
        kw.update(num_local_experts=num_experts, num_experts_per_tok=top_k)
        kw["intermediate_size"] = intermediate_size
    elif model_type in ("qwen3_moe", "qwen2_moe", "olmoe"):
        kw.update(num_experts=num_experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=intermediate_size, norm_topk_prob=True)
        if model_type == "olmoe":
            kw["intermediate_size"] = intermediate_size
        if model_type == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = intermediate_size * 2
    elif model_type == "glm4_moe":
        # one dense layer before the MoE ones, as GLM-4.5 has, on top of ``num_layers`` MoE layers
        kw.update(n_routed_experts=num_experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=intermediate_size, n_shared_experts=1,
                  num_hidden_layers=num_layers + 1, first_k_dense_replace=1,
                  n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                  num_nextn_predict_layers=1)
    elif model_type == "deepseek_v3":
        # GLM's router layout (dense first layer, shared expert, two groups) with latent
        # attention: a query rank, a kv latent of 32 plus a 16-wide rotary key per token, and
        # yarn rope scaling with mscale, as DeepSeek-V3 and Kimi-K2 ship
        kw.update(n_routed_experts=num_experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=intermediate_size, n_shared_experts=1,
                  num_hidden_layers=num_layers + 1, first_k_dense_replace=1,
                  n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                  qk_nope_head_dim=16, v_head_dim=16, num_nextn_predict_layers=1,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=128, beta_fast=32,
                                       beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
    elif model_type == "gpt_oss":
        # sliding, full, ... layers; a 4-token window; YaRN stretching 64 positions
        kw.update(num_local_experts=num_experts, num_experts_per_tok=top_k,
                  intermediate_size=intermediate_size, head_dim=hidden_size // 4,
                  sliding_window=4, attention_bias=True,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 64})
    elif model_type == "ernie4_5_moe":
        # one dense layer before the MoE ones (moe_layer_start_index 1), as ERNIE-4.5 has
        kw.update(moe_num_experts=num_experts, moe_k=top_k,
                  moe_intermediate_size=intermediate_size, moe_num_shared_experts=2,
                  num_hidden_layers=num_layers + 1, moe_layer_start_index=1,
                  moe_layer_interval=1, moe_layer_end_index=num_layers)
    elif model_type == "qwen3_5_moe":
        # linear, full, linear, full: both token mixers twice; 4 value heads over 2 key heads
        # (the hub models' 2:1), a 4-tap conv, rotary over a quarter of each 32-wide head
        layers = max(num_layers, 4)
        model_type = "qwen3_5_moe_text"
        kw.update(num_experts=num_experts, num_experts_per_tok=top_k, num_hidden_layers=layers,
                  moe_intermediate_size=intermediate_size, head_dim=32,
                  shared_expert_intermediate_size=intermediate_size * 2,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"] * (layers // 2),
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                       partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                                       mrope_interleaved=True))
        del kw["intermediate_size"]
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)
