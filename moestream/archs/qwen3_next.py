"""Qwen3-Next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): a hybrid of Gated DeltaNet linear attention and
gated full attention (3 of every 4 layers linear, per layer_types / full_attention_interval);
zero-centred RMSNorms (scale 1 + weight); per-head q/k norm and partial rotary (a quarter of each
head) in the full-attention layers; softmax → top-k routing over 512 experts plus a shared expert
scaled by a sigmoid gate, as in Qwen2-MoE."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="qwen3_next",
    model_types=("qwen3_next",),
    router="softmax_topk",
    mixer="gated_gqa",
    layer_mixers={"linear_attention": "gated_deltanet", "full_attention": "gated_gqa"},
    norm="zero_centred_rms",
    qk_norm="per_head",
    shared_expert=True,
    shared_expert_gate=True,
    partial_rotary=True,
    variants={"hidden_act": ("silu",)},
    keys={"num_experts": ("num_experts", "num_local_experts")},
    # transformers' Qwen3NextConfig defaults (for keys a config.json may leave out).
    defaults={"norm_topk_prob": True, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
              "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "attention_bias": False},
)
