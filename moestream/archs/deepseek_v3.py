"""DeepSeek-V3 (V3, V3.1, R1 and their shape): multi-head latent attention (a latent KV cache, rope
pairs interleaved unless rope_interleave is false, yarn with mscale sharpening the softmax), the
sigmoid_grouped router (noaux_tc: a selection-only correction bias, group-limited top-k by each
group's best two, routed scaling); n_shared_experts as one wide MLP; the first first_k_dense_replace
layers dense. Its multi-token-prediction layer (after the last decoder layer) is not run, as in
transformers."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    router="sigmoid_grouped",
    mixer="mla",
    shared_expert=True,
    shared_expert_name="shared_experts",
    # transformers' DeepseekV3 always routes noaux_tc and ignores moe_layer_freq: refuse anything else.
    variants={"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "moe_layer_freq": (1,),
              "hidden_act": ("silu",)},
    keys={"num_experts": ("n_routed_experts", "num_local_experts", "num_experts")},
    # transformers' DeepseekV3Config defaults (for keys a config.json may leave out).
    defaults={"n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
              "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 4096},
)
