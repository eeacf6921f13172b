"""Qwen3.5-MoE, text-only export (model_type qwen3_5_moe_text): Qwen3-Next's hybrid of Gated
DeltaNet and gated full attention, with the linear layers' in-projections stored split
(in_proj_qkv / _z / _b / _a, plain head order), every layer an MoE layer and the top-k weights
always renormalised. Its multimodal rotary (mrope) is plain rotary for text, where the three
position streams coincide. The vision-language checkpoints (model_type qwen3_5_moe: text_config
nested, weights under model.language_model) are not read."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    router="softmax_topk",
    mixer="gated_gqa",
    layer_mixers={"linear_attention": "gated_deltanet", "full_attention": "gated_gqa"},
    linear_projections="split",
    norm="zero_centred_rms",
    qk_norm="per_head",
    shared_expert=True,
    shared_expert_gate=True,
    partial_rotary=True,
    variants={"hidden_act": ("silu",)},
    # transformers renormalises the top-k whatever the config says: no key is read for it (an empty
    # key list leaves the default).
    keys={"num_experts": ("num_experts", "num_local_experts"), "norm_topk_prob": ()},
    defaults={"norm_topk_prob": True, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
              "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "attention_bias": False},
)
