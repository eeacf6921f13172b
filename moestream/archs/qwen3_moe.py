"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, softmax→top-k, no shared expert."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    router="softmax_topk",
    qk_norm="per_head",
    keys={"num_experts": ("num_experts", "num_local_experts")},
)
