"""OLMoE: RMSNorm over the full q and k projections (not per head), optional q/k/v clipping."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="olmoe",
    model_types=("olmoe",),
    router="softmax_topk",
    qk_norm="full",
    keys={
        "num_experts": ("num_experts", "num_local_experts"),
        "moe_intermediate_size": ("intermediate_size",),
    },
    defaults={"intermediate_size": 0},
)
