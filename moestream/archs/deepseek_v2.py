"""DeepSeek-V2 (V2, V2-Lite, V2.5, Coder-V2): multi-head latent attention (a latent KV cache; a plain
q_proj where q_lora_rank is null, as in V2-Lite; rope dims rotated as adjacent pairs), softmax
routing, greedy or group-limited (a group scored by its best expert) top-k with routed scaling;
n_shared_experts stored as one wide MLP; the first first_k_dense_replace layers dense."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    router="softmax_grouped",
    mixer="mla",
    shared_expert=True,
    shared_expert_name="shared_experts",
    grouped_by=("topk_method", ("group_limited_greedy",)),
    # transformers' DeepseekV2 router ignores norm_topk_prob (the original code renormalised and then
    # skipped the scaling), and its layers ignore moe_layer_freq: only the settings where every reading
    # agrees (the released checkpoints') are accepted.
    variants={"topk_method": ("greedy", "group_limited_greedy"), "scoring_func": ("softmax",),
              "norm_topk_prob": (False,), "moe_layer_freq": (1,), "hidden_act": ("silu",), "mlp_bias": (False,)},
    # DeepSeek-V2 always rotates interleaved pairs: transformers reads no rope_interleave for it.
    keys={"num_experts": ("n_routed_experts", "num_experts"), "rope_interleave": ()},
    # transformers' DeepseekV2Config defaults (for keys a config.json may leave out).
    defaults={"topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
              "routed_scaling_factor": 1.0, "n_shared_experts": 2, "first_k_dense_replace": 0,
              "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "rope_interleave": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
)
