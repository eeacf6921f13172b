"""What differs between MoE families, as data: the model code reads an ArchSpec, never a family name.

An ArchSpec says how to read a family's config.json into a `ModelConfig` (the normalised shape
every module is built from) and what its tensors are called on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_grouped", "softmax_grouped", "scaled_softmax_topk"]
QKNorm = Literal["none", "per_head", "full"]


@dataclass(frozen=True)
class ArchSpec:
    """One model family.

    `router`: a kind of `model.routers.ROUTERS`: softmax_topk = softmax over all experts, then top-k
    (renormalised when the config's norm_topk_prob says so); topk_softmax = top-k on the logits,
    then softmax over those k (Mixtral); sigmoid_grouped = sigmoid scores, a correction bias that
    steers the choice only, group-limited top-k, routed scaling (GLM-4.5, DeepSeek-V3);
    softmax_grouped = softmax scores, group-limited top-k (a group scored by its best expert), routed
    scaling (DeepSeek-V2's greedy / group_limited_greedy).
    `mixer`: a kind of `model.attention.MIXERS` (the attention half of a layer and its cache kind).
    `qk_norm`: RMSNorm on queries and keys per head (Qwen3) or over the full projection (OLMoE).
    `qk_norm_switch`: a config.json bool that turns `qk_norm` on or off per checkpoint (GLM's
    use_qk_norm: GLM-4.5 has the norms, GLM-4.5-Air not); None when the family always has `qk_norm`.
    `shared_expert_name`: the shared expert's module name on disk (`shared_expert` in Qwen2-MoE,
    `shared_experts` in GLM / DeepSeek, where n_shared_experts of them are stored as one wide MLP).
    `partial_rotary`: rotary applies to the leading partial_rotary_factor of each head only (GLM).
    `layer_mixers`: for families that mix token mixers, config.json's layer type (`layer_types`,
    else every `full_attention_interval`-th layer full attention) → its kind of `MIXERS`; empty:
    every layer is `mixer`. `norm`: a kind of `model.norms.NORMS` for the layer and final norms.
    `linear_projections`: how Gated DeltaNet's in-projections are stored: `per_key_head` =
    in_proj_qkvz + in_proj_ba, grouped by key head (Qwen3-Next); `split` = in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a in plain head order (Qwen3.5).
    `grouped_by`: (config.json key, values) for families where a key switches group-limited routing
    on: only those values keep `n_group` / `topk_group` (DeepSeek-V2's topk_method
    "group_limited_greedy"); any other value routes over all experts whatever the groups say
    ("greedy"). None: the groups always apply.
    `mlp_layer_types`: config.json's `mlp_layer_types` ("dense" / "sparse" per layer) decides which
    layers are MoE (GLM-4.7-Flash, as transformers reads it); else first_k_dense_replace and the
    Qwen keys do.
    `router_bias`: the router's linear layer has a bias (`<router>.bias`, GPT-OSS).
    `expert_layout`: how routed experts are stored: `per_expert` = `experts.E.<gate/up/down>.weight`
    (`expert_names`); `stacked` = GPT-OSS's `experts.gate_up_proj` (E, H, 2I), gate and up columns
    interleaved, `experts.down_proj` (E, I, H) and their `_bias` tensors (`stacked_expert_names`).
    `expert_bias`: the routed experts' projections carry biases. `expert_activation`: a kind of
    `kernels.moe_reference.ACTIVATIONS` (`swiglu`, or GPT-OSS's `swiglu_clamped`, whose alpha and
    limit config.json gives as swiglu_alpha / swiglu_limit).
    `expert_layout` `stacked_rows`: transformers v5's own stacking (Gemma 4): `experts.gate_up_proj`
    (E, 2I, H) gate rows first, `experts.down_proj` (E, H, I), no biases: one expert is one byte
    range of each, already in the dense format's layout. `moe_prefix` "" puts the router and the
    experts straight under the layer (`model.layers.N.router`, `model.layers.N.experts`).
    `layer`: a kind of `model.decoder.LAYERS`: `standard` = norm → mixer → residual, norm → MoE or
    dense FFN → residual; `gemma4` = Gemma 4's sandwich-normed layer with a dense GeGLU MLP beside
    the routed experts and a per-layer output scalar (model/gemma4_layer.py).
    `embed_scale`: the embeddings are multiplied by sqrt(hidden_size) (Gemma).
    `global_layers`: the full-attention layers have their own head size, key/value heads and rotary
    (Gemma 4's global layers: `ModelConfig.global_attention`), rope_parameters is nested per layer
    type (defaults `rope_sliding_attention` / `rope_full_attention`), and the last layer is always
    full attention (transformers forces it).
    `variants`: config.json keys naming a variant of the family, with the values moestream implements;
    any other value is refused when the config is read, rather than run wrongly.
    `keys`: for each ModelConfig field, the config.json keys that may hold it, first match wins.
    `defaults`: values used when config.json holds none of those keys (the transformers defaults).
    """

    name: str
    model_types: tuple[str, ...]
    router: RouterKind
    mixer: str = "gqa"
    qk_norm: QKNorm = "none"
    qk_norm_switch: str | None = None
    moe_prefix: str = "mlp"
    router_name: str = "gate"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: bool = False
    shared_expert_gate: bool = False
    shared_expert_name: str = "shared_expert"
    partial_rotary: bool = False
    layer_mixers: dict[str, str] = field(default_factory=dict)
    norm: str = "rms"
    linear_projections: Literal["per_key_head", "split"] = "per_key_head"
    grouped_by: tuple[str, tuple[Any, ...]] | None = None
    mlp_layer_types: bool = False
    router_bias: bool = False
    expert_layout: Literal["per_expert", "stacked", "stacked_rows"] = "per_expert"
    expert_bias: bool = False
    expert_activation: str = "swiglu"
    layer: str = "standard"
    embed_scale: bool = False
    global_layers: bool = False
    variants: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """On-disk names of one expert's gate, up and down projection weights."""
        base = f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}"
        return tuple(f"{base}.{n}.weight" for n in self.expert_names)  # type: ignore[return-value]

    def stacked_expert_names(self, layer: int) -> dict[str, str]:
        """On-disk names of one layer's stacked expert tensors (`expert_layout = "stacked"`)."""
        base = f"model.layers.{layer}.{self.moe_prefix}.experts" if self.moe_prefix else f"model.layers.{layer}.experts"
        return {"gate_up": f"{base}.gate_up_proj", "gate_up_bias": f"{base}.gate_up_proj_bias",
                "down": f"{base}.down_proj", "down_bias": f"{base}.down_proj_bias"}

    def mixer_of(self, config: ModelConfig, layer: int) -> str:
        """The MIXERS kind of one layer: as config.json's layer types say, else the family's one kind."""
        return config.layer_mixers[layer] if config.layer_mixers else self.mixer

    def resolved(self, config: ModelConfig) -> ArchSpec:
        """This spec with what config.json switches per checkpoint (GLM's use_qk_norm) applied, so
        that modules reading the spec build exactly the tensors the checkpoint holds."""
        if config.qk_norm is None or config.qk_norm == self.qk_norm:
            return self
        return replace(self, qk_norm=config.qk_norm)


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
class LinearAttentionConfig:
    """Gated DeltaNet's sizes (Qwen3-Next's linear_* keys): each key head serves value_heads //
    key_heads value heads, as GQA's key/value heads serve query heads; a causal conv of
    `conv_kernel` taps runs over q, k and v before the delta rule."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3, GLM-4.7-Flash): a query through a low-rank
    bottleneck of `q_lora_rank` (None: one plain q_proj), keys and values compressed together into a
    `kv_lora_rank` latent plus one `qk_rope_head_dim` rope key shared by every head (what the cache
    keeps), expanded per head to `qk_nope_head_dim` key and `v_head_dim` value dims.
    `rope_interleave`: the rope dims rotate as adjacent pairs (DeepSeek's layout), not half-split.
    `softmax_scale`: 1/sqrt(qk_nope + qk_rope), times yarn's mscale(factor, mscale_all_dim)² when
    the rope is scaled, as transformers computes it."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float


@dataclass(frozen=True)
class GlobalAttentionConfig:
    """Gemma 4's full-attention layers, which differ from its sliding ones (whose sizes and rotary
    are ModelConfig's own): wider heads (`head_dim`, config.json's global_head_dim or
    per_layer_config), their own key/value heads, `k_eq_v` (attention_k_eq_v: no v_proj, the values
    are the key projection before k_norm), and their own rotary (`rope`; `rotary_fraction` of each
    head's frequencies non-zero: transformers' proportional rope, the rest rotate by zero)."""

    head_dim: int
    kv_heads: int
    k_eq_v: bool
    rope: RopeConfig
    rotary_fraction: float = 1.0


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
    # Defaults keep configs built by hand (tests, tools) valid; config.py always sets them.
    qk_norm: QKNorm | None = None         # as the spec says, unless config.json switches it (GLM)
    rotary_dim: int | None = None         # leading dims of each head that rotary rotates; None: all
    n_group: int = 1                      # expert groups (group-limited routing)
    topk_group: int = 1                   # groups kept per token before the top-k
    routed_scaling_factor: float = 1.0    # multiplies the routed experts' weights
    layer_mixers: tuple[str, ...] = ()    # MIXERS kind per layer where the family mixes them; (): spec.mixer
    linear_attention: LinearAttentionConfig | None = None   # sizes of the linear-attention layers, if any
    latent_attention: LatentAttentionConfig | None = None   # MLA sizes, if the layers use it
    sliding_window: int | None = None     # keys a sliding-window layer attends to, its own included
    router_bias: bool = False             # the router's linear layer has a bias (GPT-OSS)
    expert_bias: bool = False             # the routed experts' projections have biases (GPT-OSS)
    expert_activation: str = "swiglu"     # a kernels.moe_reference activation
    swiglu_alpha: float = 1.702           # swiglu_clamped's sigmoid gain and clamp (GPT-OSS)
    swiglu_limit: float = 7.0
    global_attention: GlobalAttentionConfig | None = None   # Gemma 4's full layers, if they differ
    final_logit_softcap: float | None = None   # logits = cap * tanh(logits / cap) (Gemma)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    def expert_numel(self) -> int:
        """Parameters of one routed expert: gate, up (I×H each) and down (H×I), and their biases."""
        biases = 2 * self.moe_intermediate + self.hidden_size if self.expert_bias else 0
        return 3 * self.moe_intermediate * self.hidden_size + biases
