"""Mixtral: `block_sparse_moe.experts.E.w1/w3/w2`, top-k on the logits then softmax over those k."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="mixtral",
    model_types=("mixtral",),
    router="topk_softmax",
    moe_prefix="block_sparse_moe",
    expert_names=("w1", "w3", "w2"),
    keys={
        "num_experts": ("num_local_experts", "num_experts"),
        "moe_intermediate_size": ("intermediate_size",),
    },
    defaults={"attention_bias": False, "norm_topk_prob": True, "intermediate_size": 0},
)
