"""What differs between MoE families, as data: the model code reads an ArchSpec, never a family name.

An ArchSpec says how to read a family's config.json into a `ModelConfig` (the normalised shape
every module is built from) and what its tensors are called on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

RouterKind = Literal["softmax_topk", "topk_softmax"]
QKNorm = Literal["none", "per_head", "full"]


@dataclass(frozen=True)
class ArchSpec:
    """One model family.

    `router`: a kind of `model.routers.ROUTERS`: softmax_topk = softmax over all experts, then top-k
    (renormalised when the config's norm_topk_prob says so); topk_softmax = top-k on the logits,
    then softmax over those k (Mixtral).
    `mixer`: a kind of `model.attention.MIXERS` (the attention half of a layer and its cache kind).
    `qk_norm`: RMSNorm on queries and keys per head (Qwen3) or over the full projection (OLMoE).
    `keys`: for each ModelConfig field, the config.json keys that may hold it, first match wins.
    `defaults`: values used when config.json holds none of those keys (the transformers defaults).
    """

    name: str
    model_types: tuple[str, ...]
    router: RouterKind
    mixer: str = "gqa"
    qk_norm: QKNorm = "none"
    moe_prefix: str = "mlp"
    router_name: str = "gate"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: bool = False
    shared_expert_gate: bool = False
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """On-disk names of one expert's gate, up and down projection weights."""
        base = f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}"
        return tuple(f"{base}.{n}.weight" for n in self.expert_names)  # type: ignore[return-value]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"          # default | linear | dynamic | yarn | llama3
    factor: float = 1.0
    original_max_position: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.extra).get(key, default)


@dataclass(frozen=True)
class ModelConfig:
    """The normalised shape of a model; every module is built from this, whatever the family."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate: int
    dense_intermediate: int
    shared_intermediate: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    qkv_bias: bool
    o_bias: bool
    clip_qkv: float | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    checkpoint_dtype: str | None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    def expert_numel(self) -> int:
        """Parameters of one routed expert: gate, up (I×H each) and down (H×I)."""
        return 3 * self.moe_intermediate * self.hidden_size
