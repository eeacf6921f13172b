"""Qwen1.5/Qwen2-MoE: q/k/v biases, a shared expert scaled by a sigmoid gate beside the routed ones."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    router="softmax_topk",
    shared_expert=True,
    shared_expert_gate=True,
    keys={"num_experts": ("num_experts", "num_local_experts")},
    # Qwen1.5-MoE configs predate the qkv_bias key: q, k and v always carry a bias there.
    defaults={"qkv_bias": True, "attention_bias": False},
)
