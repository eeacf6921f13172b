"""Read a family's config.json into the normalised ModelConfig, checking every value on the way.

Each ModelConfig field comes from the config.json keys the family's ArchSpec names (first present
key wins, then the spec's defaults) and is checked against one rule of `RULES` (its type and
range) before any tensor is created; combinations that cannot work (heads not dividing, top-k
above the expert count, ids outside the vocabulary) are checked after. A bad value is one
sentence naming the key, the value and what it must be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moestream.archs.spec import ArchSpec, ModelConfig, RopeConfig
from moestream.errors import CheckpointError

_MISSING = object()


@dataclass(frozen=True)
class Rule:
    kind: str              # "int" | "float" | "bool"
    minimum: float | None = None
    exclusive: bool = False   # minimum itself is not allowed (floats that must be > 0)

    def check(self, key: str, value: Any) -> Any:
        what = {"int": "an integer", "float": "a number", "bool": "true or false"}[self.kind]
        bound = "" if self.minimum is None else f" {'>' if self.exclusive else '>='} {self.minimum:g}"
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
    hidden = _lookup(raw, spec, "hidden_size")
    heads = _lookup(raw, spec, "num_attention_heads")
    layers = _lookup(raw, spec, "num_hidden_layers")
    num_experts = _lookup(raw, spec, "num_experts")
    top_k = _lookup(raw, spec, "num_experts_per_tok")
    vocab = _lookup(raw, spec, "vocab_size")
    if top_k > num_experts:
        raise CheckpointError(f"config.json routes {top_k} of {num_experts} experts per token; fix num_experts_per_tok.")
    kv_heads = _optional(raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointError(f"config.json has {heads} attention heads and {kv_heads} key/value heads; the key/value "
                              "heads must divide the attention heads, fix the config.")
    head_dim = _optional(raw, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"config.json has hidden_size {hidden} and {heads} attention heads but no head_dim, "
                                  "and the heads do not divide the hidden size; fix the config.")
        head_dim = hidden // heads
    mlp_only = _layer_list(raw, "mlp_only_layers", layers)
    step = _optional(raw, "decoder_sparse_step", 1)
    moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(layers))
    bias = _lookup(raw, spec, "attention_bias", False)
    dense = _lookup(raw, spec, "intermediate_size", 0)
    if dense == 0 and not all(moe_layers):
        raise CheckpointError("config.json keeps some layers dense but gives no intermediate_size for them; fix the config.")
    tie = raw.get("tie_word_embeddings", False)
    return ModelConfig(
        arch=spec.name,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_lookup(raw, spec, "rms_norm_eps", 1e-6)),
        rope=_rope(raw),
        max_position=_lookup(raw, spec, "max_position_embeddings", 4096),
        tie_embeddings=RULES["tie_word_embeddings"].check("tie_word_embeddings", tie),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate=_lookup(raw, spec, "moe_intermediate_size"),
        dense_intermediate=dense,
        shared_intermediate=_lookup(raw, spec, "shared_expert_intermediate_size", 0) if spec.shared_expert else 0,
        norm_topk_prob=_lookup(raw, spec, "norm_topk_prob", False),
        moe_layers=moe_layers,
        qkv_bias=_lookup(raw, spec, "qkv_bias", bias),
        o_bias=bias,
        clip_qkv=_optional(raw, "clip_qkv", None),
        eos_token_ids=_token_ids(raw, "eos_token_id", vocab),
        bos_token_id=(_token_ids(raw, "bos_token_id", vocab) or (None,))[0],
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
