"""Tiny random Qwen3-MoE / GLM-4.5-MoE models as transformers config kwargs, shared by the parity
tests (`test_hf_parity.py`) and the recorded `config.json` files (`hf_configs/`, `record_hf_configs.py`).

Every case sets a RoPE θ other than transformers' default (10000), so reading θ wrongly changes
the logits; expert counts, top-k, renormalisation and (GLM) routing groups differ between cases.
"""

COMMON = dict(
    vocab_size=101, hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, moe_intermediate_size=24, initializer_range=0.1, max_position_embeddings=64,
)  # fmt: skip

CASES = {
    # layer 0 dense (mlp_only_layers), layers 1-2 MoE, untied head; HF writes shards.
    "qwen3_moe_untied": dict(
        COMMON, model_type="qwen3_moe", num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_theta=50000.0,
    ),  # fmt: skip
    # decoder_sparse_step=2: only layer 1 is MoE; top-3 without renormalisation; q/k/v/o biases; tied.
    "qwen3_moe_tied_bias": dict(
        COMMON, model_type="qwen3_moe", num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=False, decoder_sparse_step=2, attention_bias=True, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1000.0,
    ),  # fmt: skip
    # group-limited sigmoid routing (4 groups, keep 2), shared expert, partial rotary, q/k norm, bias.
    "glm4_moe_groups": dict(
        COMMON, model_type="glm4_moe", num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
        tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=2000.0, num_nextn_predict_layers=0,
    ),  # fmt: skip
    # no q/k norm, no renormalisation, two shared experts, tied head.
    "glm4_moe_tied": dict(
        COMMON, model_type="glm4_moe", num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=False,
        attention_bias=True, norm_topk_prob=False, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=500.0, num_nextn_predict_layers=0,
    ),  # fmt: skip
}
HF_SHARDED = {"qwen3_moe_untied", "glm4_moe_groups"}  # transformers writes these as several shards
