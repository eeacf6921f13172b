"""Read a family's config.json into the normalised ModelConfig, using its ArchSpec's key table."""

from __future__ import annotations

from typing import Any

from moestream.archs.spec import ArchSpec, ModelConfig, RopeConfig
from moestream.errors import CheckpointError

_MISSING = object()


def _lookup(raw: dict[str, Any], spec: ArchSpec, field: str, default: Any = _MISSING) -> Any:
    for key in spec.keys.get(field, (field,)):
        if raw.get(key) is not None:
            return raw[key]
    if field in spec.defaults:
        return spec.defaults[field]
    if default is not _MISSING:
        return default
    names = " or ".join(spec.keys.get(field, (field,)))
    raise CheckpointError(f"config.json has no {names}, which a {spec.name} model needs; fix or re-download the config.")


def _rope(raw: dict[str, Any]) -> RopeConfig:
    """Both spellings: transformers v5's `rope_parameters` and the older rope_theta + rope_scaling."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    factor = float(merged.pop("factor", 1.0) or 1.0)
    original = merged.pop("original_max_position_embeddings", None)
    supported = {"default", "linear", "yarn"}
    if kind not in supported:
        raise CheckpointError(f"rope type {kind!r} in config.json is not supported (supported: {', '.join(sorted(supported))}).")
    return RopeConfig(theta, kind, factor, original, tuple(sorted(merged.items())))


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def model_config_from_hf(raw: dict[str, Any], spec: ArchSpec) -> ModelConfig:
    hidden = int(_lookup(raw, spec, "hidden_size"))
    heads = int(_lookup(raw, spec, "num_attention_heads"))
    layers = int(_lookup(raw, spec, "num_hidden_layers"))
    num_experts = int(_lookup(raw, spec, "num_experts"))
    top_k = int(_lookup(raw, spec, "num_experts_per_tok"))
    if not 0 < top_k <= num_experts:
        raise CheckpointError(f"config.json routes {top_k} of {num_experts} experts per token; fix num_experts_per_tok.")
    mlp_only = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    moe_layers = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(layers))
    head_dim = raw.get("head_dim") or hidden // heads
    bias = bool(_lookup(raw, spec, "attention_bias", False))
    return ModelConfig(
        arch=spec.name,
        vocab_size=int(_lookup(raw, spec, "vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(_lookup(raw, spec, "rms_norm_eps", 1e-6)),
        rope=_rope(raw),
        max_position=int(_lookup(raw, spec, "max_position_embeddings", 4096)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate=int(_lookup(raw, spec, "moe_intermediate_size")),
        dense_intermediate=int(_lookup(raw, spec, "intermediate_size", 0)),
        shared_intermediate=int(_lookup(raw, spec, "shared_expert_intermediate_size", 0)) if spec.shared_expert else 0,
        norm_topk_prob=bool(_lookup(raw, spec, "norm_topk_prob", False)),
        moe_layers=moe_layers,
        qkv_bias=bool(_lookup(raw, spec, "qkv_bias", bias)),
        o_bias=bias,
        clip_qkv=raw.get("clip_qkv"),
        eos_token_ids=_eos_ids(raw),
        bos_token_id=raw.get("bos_token_id"),
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
