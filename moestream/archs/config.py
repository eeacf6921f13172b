"""Read a family's config.json into the normalised ModelConfig, checking every value on the way.

Each ModelConfig field comes from the config.json keys the family's ArchSpec names (first present
key wins, then the spec's defaults) and is checked against one rule of `RULES` (its type and
range) before any tensor is created; combinations that cannot work (heads not dividing, top-k
above the expert count, ids outside the vocabulary, expert groups that do not split the experts)
are checked after, and a family variant moestream does not implement (the spec's `variants`) is
refused. A bad value is one sentence naming the key, the value and what it must be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moestream.archs.spec import (ArchSpec, GlobalAttentionConfig, LatentAttentionConfig, LinearAttentionConfig,
                                  ModelConfig, RopeConfig)
from moestream.errors import CheckpointError

_MISSING = object()


@dataclass(frozen=True)
class Rule:
    kind: str              # "int" | "float" | "bool"
    minimum: float | None = None
    exclusive: bool = False   # minimum itself is not allowed (floats that must be > 0)
    maximum: float | None = None   # inclusive

    def check(self, key: str, value: Any) -> Any:
        what = {"int": "an integer", "float": "a number", "bool": "true or false"}[self.kind]
        bound = "" if self.minimum is None else f" {'>' if self.exclusive else '>='} {self.minimum:g}"
        bound += "" if self.maximum is None else f"{' and' if bound else ''} <= {self.maximum:g}"
        fail = CheckpointError(f"config.json has {key} = {value!r}, which must be {what}{bound}; fix the config.")
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise fail
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail
        if self.kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise fail
            value = int(value)
        elif not math.isfinite(value):
            raise fail
        if self.minimum is not None and (value < self.minimum or (self.exclusive and value == self.minimum)):
            raise fail
        if self.maximum is not None and value > self.maximum:
            raise fail
        return value


# field → rule: every size and count of the model; eps and theta strictly positive.
RULES: dict[str, Rule] = {
    "vocab_size": Rule("int", 1), "hidden_size": Rule("int", 1), "num_hidden_layers": Rule("int", 1),
    "num_attention_heads": Rule("int", 1), "num_key_value_heads": Rule("int", 1), "head_dim": Rule("int", 1),
    "num_experts": Rule("int", 1), "num_experts_per_tok": Rule("int", 1), "moe_intermediate_size": Rule("int", 1),
    "intermediate_size": Rule("int", 0), "shared_expert_intermediate_size": Rule("int", 0),
    "max_position_embeddings": Rule("int", 2), "rms_norm_eps": Rule("float", 0, exclusive=True),
    "decoder_sparse_step": Rule("int", 1), "clip_qkv": Rule("float", 0, exclusive=True),
    "rope_theta": Rule("float", 0, exclusive=True), "factor": Rule("float", 0, exclusive=True),
    "norm_topk_prob": Rule("bool"), "attention_bias": Rule("bool"), "qkv_bias": Rule("bool"),
    "tie_word_embeddings": Rule("bool"),
    # group-limited sigmoid routing, shared experts counted in experts, leading dense layers (GLM, DeepSeek)
    "n_group": Rule("int", 1), "topk_group": Rule("int", 1), "routed_scaling_factor": Rule("float", 0, exclusive=True),
    "n_shared_experts": Rule("int", 0), "first_k_dense_replace": Rule("int", 0),
    "partial_rotary_factor": Rule("float", 0, exclusive=True, maximum=1), "use_qk_norm": Rule("bool"),
    "o_bias": Rule("bool"),
    # hybrid layer patterns and Gated DeltaNet sizes (Qwen3-Next)
    "full_attention_interval": Rule("int", 1), "linear_conv_kernel_dim": Rule("int", 1),
    "linear_num_key_heads": Rule("int", 1), "linear_num_value_heads": Rule("int", 1),
    "linear_key_head_dim": Rule("int", 1), "linear_value_head_dim": Rule("int", 1),
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash); the rope key rotates in pairs
    "q_lora_rank": Rule("int", 1), "kv_lora_rank": Rule("int", 1), "qk_nope_head_dim": Rule("int", 1),
    "qk_rope_head_dim": Rule("int", 2), "v_head_dim": Rule("int", 1), "rope_interleave": Rule("bool"),
    "mscale_all_dim": Rule("float", 0),
    # sliding-window layers and the clamped SwiGLU of the experts (GPT-OSS)
    "sliding_window": Rule("int", 1), "swiglu_alpha": Rule("float", 0, exclusive=True),
    "swiglu_limit": Rule("float", 0, exclusive=True),
    # Gemma 4: the full-attention layers' own sizes, keys shared as values there, logit soft-capping
    "global_head_dim": Rule("int", 2), "num_global_key_value_heads": Rule("int", 1), "attention_k_eq_v": Rule("bool"),
    "final_logit_softcapping": Rule("float", 0, exclusive=True),
}


def _lookup(raw: dict[str, Any], spec: ArchSpec, field: str, default: Any = _MISSING) -> Any:
    """The checked value of `field`: from the first config key the spec names, else its default."""
    for key in spec.keys.get(field, (field,)):
        if raw.get(key) is not None:
            return RULES[field].check(key, raw[key]) if field in RULES else raw[key]
    if field in spec.defaults:
        return spec.defaults[field]
    if default is not _MISSING:
        return default
    names = " or ".join(spec.keys.get(field, (field,)))
    raise CheckpointError(f"config.json has no {names}, which a {spec.name} model needs; fix or re-download the config.")


def _optional(raw: dict[str, Any], key: str, default: Any) -> Any:
    value = raw.get(key)
    return default if value is None else RULES[key].check(key, value)


def _rope(raw: dict[str, Any]) -> RopeConfig:
    """Both spellings: transformers v5's `rope_parameters` and the older rope_theta + rope_scaling."""
    params, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise CheckpointError(f"config.json has {key} = {value!r}, which must be an object; fix the config.")
    merged = {**scaling, **params}
    merged.pop("partial_rotary_factor", None)   # a head's share, not a frequency setting: see _rotary_dim
    theta = RULES["rope_theta"].check("rope_theta", merged.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    factor = RULES["factor"].check("rope factor", merged.pop("factor", 1.0) or 1.0)
    original = merged.pop("original_max_position_embeddings", None)
    if original is not None:
        original = RULES["max_position_embeddings"].check("original_max_position_embeddings", original)
    supported = {"default", "linear", "yarn"}
    if kind not in supported:
        raise CheckpointError(f"rope type {kind!r} in config.json is not supported (supported: {', '.join(sorted(supported))}).")
    return RopeConfig(float(theta), kind, float(factor), original, tuple(sorted(merged.items())))


def _rotary_dim(raw: dict[str, Any], spec: ArchSpec, head_dim: int) -> int:
    """Dims of each head that rotary rotates, as transformers computes them: int(head_dim * factor),
    the factor read from rope_parameters / rope_scaling first, then the top-level key (older configs)."""
    if not spec.partial_rotary:
        return head_dim
    key, factor = "partial_rotary_factor", None
    for block in ("rope_parameters", "rope_scaling"):
        if factor is None:
            factor = (raw.get(block) or {}).get(key)
    factor = RULES[key].check(key, factor) if factor is not None else _lookup(raw, spec, key, 1.0)
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise CheckpointError(f"config.json has partial_rotary_factor = {factor!r}, which rotates {dim} of the "
                              f"{head_dim} dims of each head; that must be an even number of at least 2, fix the config.")
    return dim


def _layer_mixers(raw: dict[str, Any], spec: ArchSpec, layers: int) -> tuple[str, ...]:
    """Each layer's MIXERS kind, for families that mix kinds: from layer_types, else (as transformers
    derives them for Qwen3-Next and GPT-OSS) every full_attention_interval-th layer full attention, the
    rest of the family's other layer type (linear attention, sliding-window attention)."""
    if not spec.layer_mixers:
        return ()
    types = raw.get("layer_types")
    if types is None:
        interval = _lookup(raw, spec, "full_attention_interval")
        other = next(kind for kind in spec.layer_mixers if kind != "full_attention")
        types = ["full_attention" if (i + 1) % interval == 0 else other for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"config.json has layer_types = {types!r}, which must list one layer type for each of "
                              f"its {layers} layers; fix the config.")
    if spec.global_layers:   # transformers makes Gemma 4's last layer full attention whatever the list says
        types = [*types[:-1], "full_attention"]
    for i, kind in enumerate(types):
        if kind not in spec.layer_mixers:
            raise CheckpointError(f"config.json makes layer {i} a {kind!r} layer, a layer type {spec.name} does not "
                                  f"have (supported: {', '.join(spec.layer_mixers)}); fix layer_types.")
    return tuple(spec.layer_mixers[kind] for kind in types)


def _sliding_window(raw: dict[str, Any], spec: ArchSpec, mixers: tuple[str, ...]) -> int | None:
    """The window of the sliding-window layers (layer type sliding_attention), read only when some
    layer is one; an explicit null is refused (transformers has no window to apply then either)."""
    kind = spec.layer_mixers.get("sliding_attention")
    if kind is None or kind not in mixers:
        return None
    if "sliding_window" in raw and raw["sliding_window"] is None:
        raise CheckpointError("config.json makes some layers sliding_attention layers but has sliding_window = null; "
                              "set the window size, fix the config.")
    return _lookup(raw, spec, "sliding_window")


def _expert_kind(raw: dict[str, Any], spec: ArchSpec) -> dict[str, Any]:
    """Router bias, expert biases and activation (with the clamped SwiGLU's alpha and limit) as ModelConfig fields."""
    out = dict(router_bias=spec.router_bias, expert_bias=spec.expert_bias, expert_activation=spec.expert_activation)
    if spec.expert_activation == "swiglu_clamped":
        out.update(swiglu_alpha=float(_lookup(raw, spec, "swiglu_alpha")),
                   swiglu_limit=float(_lookup(raw, spec, "swiglu_limit")))
    return out


def _check_quantization(raw: dict[str, Any], spec: ArchSpec) -> None:
    """A Hugging Face quantization moestream does not read is refused by name before any tensor is
    (MLX's quantization, which it reads, is `quantization` with bits and group_size: quant/mlx.py;
    MXFP4 is read for the families whose experts are stored as gpt-oss stores them)."""
    q = raw.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4" and spec.expert_layout != "stacked":
        raise CheckpointError(f"config.json says the weights are MXFP4-quantized (quantization_config.quant_method = "
                              f"'mxfp4'), which moestream reads for gpt-oss's experts only, not {spec.name}'s; use a "
                              "bf16 export of the model.")


def _linear_attention(raw: dict[str, Any], spec: ArchSpec, mixers: tuple[str, ...]) -> LinearAttentionConfig | None:
    """Gated DeltaNet's sizes, read only when some layer is one."""
    if "gated_deltanet" not in mixers:
        return None
    key_heads, value_heads = _lookup(raw, spec, "linear_num_key_heads"), _lookup(raw, spec, "linear_num_value_heads")
    if value_heads % key_heads:
        raise CheckpointError(f"config.json has {key_heads} linear_num_key_heads and {value_heads} "
                              "linear_num_value_heads; the key heads must divide the value heads, fix the config.")
    return LinearAttentionConfig(key_heads, value_heads, _lookup(raw, spec, "linear_key_head_dim"),
                                 _lookup(raw, spec, "linear_value_head_dim"),
                                 _lookup(raw, spec, "linear_conv_kernel_dim"))


def _latent_attention(raw: dict[str, Any], spec: ArchSpec, mixers: tuple[str, ...],
                      rope: RopeConfig) -> LatentAttentionConfig | None:
    """MLA's sizes, read only when some layer is MLA. q_lora_rank may be null on purpose (a plain
    q_proj: DeepSeek-V2-Lite), so an explicit null is kept rather than replaced by the default."""
    if "mla" not in (mixers or (spec.mixer,)):
        return None
    if "q_lora_rank" in raw:
        q_rank = None if raw["q_lora_rank"] is None else RULES["q_lora_rank"].check("q_lora_rank", raw["q_lora_rank"])
    else:
        q_rank = spec.defaults.get("q_lora_rank")
    rope_dim = _lookup(raw, spec, "qk_rope_head_dim")
    if rope_dim % 2:
        raise CheckpointError(f"config.json has qk_rope_head_dim = {rope_dim}, which rotary splits into pairs; it "
                              "must be even, fix the config.")
    for factor in (raw.get("partial_rotary_factor"), *((raw.get(b) or {}).get("partial_rotary_factor")
                                                       for b in ("rope_parameters", "rope_scaling"))):
        if factor is not None and factor != 1:
            raise CheckpointError(f"config.json has partial_rotary_factor = {factor!r}, but multi-head latent "
                                  "attention rotates the whole rope key (qk_rope_head_dim); fix the config.")
    nope, v_dim = _lookup(raw, spec, "qk_nope_head_dim"), _lookup(raw, spec, "v_head_dim")
    scale = (nope + rope_dim) ** -0.5
    # transformers' yarn_apply_mscale: any scaled rope with mscale_all_dim sharpens the softmax by mscale².
    mscale_all_dim = rope.get("mscale_all_dim")
    if rope.kind != "default" and mscale_all_dim:
        m = RULES["mscale_all_dim"].check("mscale_all_dim", mscale_all_dim)
        mscale = 1.0 if rope.factor <= 1 else 0.1 * m * math.log(rope.factor) + 1.0
        scale = scale * mscale * mscale
    return LatentAttentionConfig(q_rank, _lookup(raw, spec, "kv_lora_rank"), nope, rope_dim, v_dim,
                                 _lookup(raw, spec, "rope_interleave", True), scale)


def _mlp_layer_types(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers are MoE, from mlp_layer_types ("dense" / "sparse" per layer)."""
    types = raw["mlp_layer_types"]
    if not isinstance(types, list) or len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise CheckpointError(f"config.json has mlp_layer_types = {types!r}, which must list 'dense' or 'sparse' for "
                              f"each of its {layers} layers; fix the config.")
    return tuple(t == "sparse" for t in types)


def _groups(raw: dict[str, Any], spec: ArchSpec) -> tuple[int, int]:
    """(n_group, topk_group) as routing uses them: (1, 1) where the family's switch (DeepSeek-V2's
    topk_method) says the groups do not limit the choice, whatever config.json's n_group says."""
    if spec.grouped_by is not None:
        key, grouped = spec.grouped_by
        method = raw.get(key) if raw.get(key) is not None else spec.defaults.get(key)
        if method not in grouped:
            return 1, 1
    return _lookup(raw, spec, "n_group", 1), _lookup(raw, spec, "topk_group", 1)


def _check_variants(raw: dict[str, Any], spec: ArchSpec) -> None:
    """A key absent from config.json is the spec's default (transformers' default): Gemma 4 without
    hidden_size_per_layer_input has per-layer embeddings, which moestream does not implement."""
    for key, allowed in spec.variants.items():
        value = raw[key] if key in raw else spec.defaults.get(key)
        if value is not None and value not in allowed:
            said = "" if key in raw else " (its default: config.json does not set it)"
            raise CheckpointError(f"config.json has {key} = {value!r}{said}, a {spec.name} variant moestream does not "
                                  f"implement (supported: {', '.join(map(repr, allowed))}); use a supported checkpoint.")


def _typed_rope(raw: dict[str, Any], spec: ArchSpec, layer_type: str) -> dict[str, Any]:
    """One layer type's rotary settings where config.json nests them per layer type (Gemma 4's
    rope_parameters {"sliding_attention": {...}, "full_attention": {...}}), in the flat form `_rope`
    reads; absent: transformers' defaults for that type (the spec's `rope_<type>`)."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"config.json has rope_parameters = {params!r}, which must be an object; fix the config.")
    typed = (params or {}).get(layer_type)
    if typed is None:
        typed = spec.defaults[f"rope_{layer_type}"]
    if not isinstance(typed, dict):
        raise CheckpointError(f"config.json has rope_parameters.{layer_type} = {typed!r}, which must be an object; "
                              "fix the config.")
    return {"rope_parameters": typed}


def _layer_shape(raw: dict[str, Any], layer: int, head_dim: int, kv_heads: int) -> tuple[int, int]:
    """(head_dim, key/value heads) of one layer after config.json's per_layer_config overrides."""
    table = raw.get("per_layer_config") or {}
    if not isinstance(table, dict):
        raise CheckpointError(f"config.json has per_layer_config = {table!r}, which must be an object; fix the config.")
    override = table.get(str(layer), table.get(layer)) or {}
    return (RULES["head_dim"].check("per_layer_config head_dim", override.get("head_dim", head_dim)),
            RULES["num_key_value_heads"].check("per_layer_config num_key_value_heads",
                                               override.get("num_key_value_heads", kv_heads)))


def _global_attention(raw: dict[str, Any], spec: ArchSpec, mixers: tuple[str, ...], heads: int, head_dim: int,
                      kv_heads: int) -> GlobalAttentionConfig | None:
    """Gemma 4's full-attention layers: head size and key/value heads from per_layer_config (what
    transformers saves) or global_head_dim / num_global_key_value_heads (what Google's configs hold;
    the latter only where attention_k_eq_v), their own rotary. Every sliding layer must keep the base
    shape and every full layer share one, as the caches and mixers are built per kind."""
    if not spec.global_layers:
        return None
    full = spec.layer_mixers["full_attention"]
    k_eq_v = _lookup(raw, spec, "attention_k_eq_v", False)
    if raw.get("per_layer_config") is None:
        g_kv = _optional(raw, "num_global_key_value_heads", None) if k_eq_v else None
        shapes = {i: ((_lookup(raw, spec, "global_head_dim"), g_kv or kv_heads) if kind == full
                      else (head_dim, kv_heads)) for i, kind in enumerate(mixers)}
    else:
        shapes = {i: _layer_shape(raw, i, head_dim, kv_heads) for i in range(len(mixers))}
    sliding = {shapes[i] for i, kind in enumerate(mixers) if kind != full}
    globals_ = {shapes[i] for i, kind in enumerate(mixers) if kind == full}
    if sliding - {(head_dim, kv_heads)} or len(globals_) != 1:
        raise CheckpointError(f"config.json gives the layers head sizes and key/value heads {sorted(set(shapes.values()))}; "
                              "moestream needs the sliding layers at head_dim / num_key_value_heads and every full "
                              "layer alike; fix per_layer_config.")
    g_dim, g_kv = globals_.pop()
    if heads % g_kv:
        raise CheckpointError(f"config.json has {heads} attention heads and {g_kv} key/value heads in its full-attention "
                              "layers; the key/value heads must divide the attention heads, fix the config.")
    typed = _typed_rope(raw, spec, "full_attention")["rope_parameters"]
    kind = typed.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise CheckpointError(f"config.json's full-attention rope type {kind!r} is not supported (supported: default, "
                              "proportional); use a supported checkpoint.")
    key = "partial_rotary_factor"
    fraction = RULES[key].check(key, typed.get(key, 1.0)) if kind == "proportional" else 1.0
    factor = RULES["factor"].check("rope factor", typed.get("factor", 1.0)) if kind == "proportional" else 1.0
    theta = RULES["rope_theta"].check("rope_theta", typed.get("rope_theta", 10000.0))
    return GlobalAttentionConfig(g_dim, g_kv, k_eq_v, RopeConfig(float(theta), kind, float(factor)), float(fraction))


def _check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int, scored_by: int = 2) -> None:
    """Group-limited routing must be able to pick top_k experts from the topk_group best groups;
    `scored_by`: how many of a group's best experts score it (2 for sigmoid routing, 1 for DeepSeek-V2's)."""
    if topk_group > n_group:
        raise CheckpointError(f"config.json keeps topk_group = {topk_group} of n_group = {n_group} expert groups; "
                              "topk_group must not exceed n_group, fix the config.")
    if num_experts % n_group:
        raise CheckpointError(f"config.json splits {num_experts} experts into n_group = {n_group} groups, which "
                              "does not divide them evenly; fix n_group.")
    per_group = num_experts // n_group
    if n_group > 1 and per_group < scored_by:
        raise CheckpointError(f"config.json splits {num_experts} experts into {n_group} groups of {per_group}, but "
                              f"a group is scored by its best {'two experts' if scored_by == 2 else 'expert'}; "
                              "fix n_group.")
    if top_k > topk_group * per_group:
        raise CheckpointError(f"config.json routes {top_k} experts per token from topk_group = {topk_group} groups of "
                              f"{per_group} experts; fix num_experts_per_tok, topk_group or n_group.")


def _token_ids(raw: dict[str, Any], key: str, vocab: int) -> tuple[int, ...]:
    value = raw.get(key)
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise CheckpointError(f"config.json has {key} = {value!r}, which must be token ids in 0..{vocab - 1}; "
                                  "fix the config.")
    return tuple(ids)


def _layer_list(raw: dict[str, Any], key: str, layers: int) -> set[int]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                              for i in value):
        raise CheckpointError(f"config.json has {key} = {value!r}, which must list layer indices in 0..{layers - 1}; "
                              "fix the config.")
    return set(value)


def model_config_from_hf(raw: dict[str, Any], spec: ArchSpec) -> ModelConfig:
    _check_variants(raw, spec)
    _check_quantization(raw, spec)
    hidden = _lookup(raw, spec, "hidden_size")
    heads = _lookup(raw, spec, "num_attention_heads")
    layers = _lookup(raw, spec, "num_hidden_layers")
    num_experts = _lookup(raw, spec, "num_experts")
    top_k = _lookup(raw, spec, "num_experts_per_tok")
    vocab = _lookup(raw, spec, "vocab_size")
    if top_k > num_experts:
        raise CheckpointError(f"config.json routes {top_k} of {num_experts} experts per token; fix num_experts_per_tok.")
    n_group, topk_group = _groups(raw, spec)
    _check_groups(num_experts, top_k, n_group, topk_group, 1 if spec.router == "softmax_grouped" else 2)
    kv_heads = _optional(raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointError(f"config.json has {heads} attention heads and {kv_heads} key/value heads; the key/value "
                              "heads must divide the attention heads, fix the config.")
    rope = _rope(_typed_rope(raw, spec, "sliding_attention") if spec.global_layers else raw)
    mixers = _layer_mixers(raw, spec, layers)
    latent = _latent_attention(raw, spec, mixers, rope)
    # MLA: every head attends to its own expansion of the one latent, so there are no key/value head
    # groups; a query/key head is qk_nope + qk_rope wide (config.json's head_dim is the rope part).
    head_dim = None if latent is None else latent.qk_nope_head_dim + latent.qk_rope_head_dim
    if latent is not None and kv_heads != heads:
        raise CheckpointError(f"config.json has {heads} attention heads and {kv_heads} key/value heads, but multi-head "
                              "latent attention expands its latent to every head; num_key_value_heads must equal "
                              "num_attention_heads, fix the config.")
    if head_dim is None:
        head_dim = _optional(raw, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"config.json has hidden_size {hidden} and {heads} attention heads but no head_dim, "
                                  "and the heads do not divide the hidden size; fix the config.")
        head_dim = hidden // heads
    mlp_only = _layer_list(raw, "mlp_only_layers", layers)
    step = _optional(raw, "decoder_sparse_step", 1)
    first_dense = _lookup(raw, spec, "first_k_dense_replace", 0)
    moe_layers = tuple(i >= first_dense and i not in mlp_only and (i + 1) % step == 0 for i in range(layers))
    if spec.mlp_layer_types and raw.get("mlp_layer_types") is not None:
        moe_layers = _mlp_layer_types(raw, layers)
    if not any(moe_layers):
        raise CheckpointError(f"config.json keeps all {layers} layers dense (first_k_dense_replace, mlp_only_layers, "
                              "decoder_sparse_step or mlp_layer_types), so this is not a Mixture-of-Experts model; "
                              "fix the config.")
    bias = _lookup(raw, spec, "attention_bias", False)
    dense = _lookup(raw, spec, "intermediate_size", 0)
    if dense == 0 and not all(moe_layers):
        raise CheckpointError("config.json keeps some layers dense but gives no intermediate_size for them; fix the config.")
    tie = raw.get("tie_word_embeddings", spec.defaults.get("tie_word_embeddings", False))
    moe_intermediate = _lookup(raw, spec, "moe_intermediate_size")
    shared = 0
    if spec.shared_expert:
        # GLM / DeepSeek count shared experts of the routed width, stored as one MLP n_shared_experts wide.
        n_shared = _lookup(raw, spec, "n_shared_experts", None)
        shared = (n_shared * moe_intermediate if n_shared is not None
                  else _lookup(raw, spec, "shared_expert_intermediate_size", 0))
    qk_norm = spec.qk_norm
    if spec.qk_norm_switch is not None and not _lookup(raw, spec, spec.qk_norm_switch, False):
        qk_norm = "none"
    return ModelConfig(
        arch=spec.name,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_lookup(raw, spec, "rms_norm_eps", 1e-6)),
        rope=rope,
        max_position=_lookup(raw, spec, "max_position_embeddings", 4096),
        tie_embeddings=RULES["tie_word_embeddings"].check("tie_word_embeddings", tie),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate=moe_intermediate,
        dense_intermediate=dense,
        shared_intermediate=shared,
        norm_topk_prob=_lookup(raw, spec, "norm_topk_prob", False),
        moe_layers=moe_layers,
        qkv_bias=_lookup(raw, spec, "qkv_bias", bias),
        o_bias=_lookup(raw, spec, "o_bias", bias),
        clip_qkv=_optional(raw, "clip_qkv", None),
        eos_token_ids=_token_ids(raw, "eos_token_id", vocab),
        bos_token_id=(_token_ids(raw, "bos_token_id", vocab) or (None,))[0],
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        qk_norm=qk_norm,
        rotary_dim=latent.qk_rope_head_dim if latent is not None else _rotary_dim(raw, spec, head_dim),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(_lookup(raw, spec, "routed_scaling_factor", 1.0)),
        layer_mixers=mixers,
        linear_attention=_linear_attention(raw, spec, mixers),
        latent_attention=latent,
        sliding_window=_sliding_window(raw, spec, mixers),
        **_expert_kind(raw, spec),
        global_attention=_global_attention(raw, spec, mixers, heads, head_dim, kv_heads),
        final_logit_softcap=_optional(raw, "final_logit_softcapping", None),
    )
