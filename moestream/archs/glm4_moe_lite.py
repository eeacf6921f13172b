"""GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's layer on a smaller scale. Multi-head latent attention
(a latent KV cache, rope pairs interleaved unless rope_interleave is false), the sigmoid_grouped
router (selection-only correction bias, routed scaling), one shared expert; dense layers as
mlp_layer_types lists them, by default the first only (transformers reads no first_k_dense_replace
for this family: without mlp_layer_types, layer 0 is dense whatever that key says)."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="glm4_moe_lite",
    model_types=("glm4_moe_lite",),
    router="sigmoid_grouped",
    mixer="mla",
    shared_expert=True,
    shared_expert_name="shared_experts",
    mlp_layer_types=True,
    variants={"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "hidden_act": ("silu",)},
    keys={"num_experts": ("n_routed_experts", "num_local_experts", "num_experts"), "first_k_dense_replace": ()},
    # transformers' Glm4MoeLiteConfig defaults (for keys a config.json may leave out).
    defaults={"n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.8,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 768, "kv_lora_rank": 512,
              "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "rope_interleave": True,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 202752},
)
