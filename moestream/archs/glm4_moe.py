"""GLM-4.5 / 4.6 / 4.7 (and -Air): sigmoid routing with a selection-only correction bias, expert
groups and routed scaling; shared experts; the first layers dense; partial rotary on half of each
head; q/k/v biases (o_proj has none); per-head q/k norm when use_qk_norm says so."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="glm4_moe",
    model_types=("glm4_moe",),
    router="sigmoid_grouped",
    qk_norm="per_head",
    qk_norm_switch="use_qk_norm",
    shared_expert=True,
    shared_expert_name="shared_experts",
    partial_rotary=True,
    # DeepSeek-style keys some exports carry: only the aux-loss-free sigmoid routing is implemented.
    variants={"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "hidden_act": ("silu",)},
    keys={
        "num_experts": ("n_routed_experts", "num_local_experts", "num_experts"),
        "qkv_bias": ("attention_bias",),
    },
    # transformers' Glm4MoeConfig defaults; attention_bias covers q, k and v only.
    defaults={"norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "partial_rotary_factor": 0.5,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "o_bias": False, "qkv_bias": False},
)
