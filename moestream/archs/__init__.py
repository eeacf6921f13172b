"""Arch registry: one small module per family; detection from config.json's model_type."""

from __future__ import annotations

from typing import Any

from moestream.archs import glm4_moe, mixtral, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next
from moestream.archs import deepseek_v2, deepseek_v3, glm4_moe_lite
from moestream.archs import gemma4, gpt_oss
from moestream.archs.config import model_config_from_hf
from moestream.archs.spec import ArchSpec, ModelConfig, RopeConfig
from moestream.errors import UnsupportedArchError

ARCHS: dict[str, ArchSpec] = {m.SPEC.name: m.SPEC for m in (qwen3_moe, qwen2_moe, mixtral, olmoe, glm4_moe, qwen3_next,
                                                              qwen3_5_moe, deepseek_v2, deepseek_v3, glm4_moe_lite,
                                                              gpt_oss, gemma4)}
# model types of families moestream reads in another layout only: a one-sentence pointer to it.
ELSEWHERE = {"gemma4": "model_type 'gemma4' is Gemma 4's multimodal wrapper, which moestream does not read; use a "
                       "text-only export of the model (model_type gemma4_text, weights under model.layers)."}


def supported_model_types() -> list[str]:
    return sorted(t for spec in ARCHS.values() for t in spec.model_types)


def detect_arch(raw_config: dict[str, Any]) -> ArchSpec:
    model_type = raw_config.get("model_type")
    if not isinstance(model_type, str):
        given = "no model_type" if model_type is None else f"model_type {model_type!r}, a {type(model_type).__name__}"
        raise UnsupportedArchError(f"config.json has {given}; it must name one model type as a string, e.g. "
                                   f"\"qwen3_moe\" (supported: {', '.join(supported_model_types())}).")
    for spec in ARCHS.values():
        if model_type in spec.model_types:
            return spec
    if model_type in ELSEWHERE:
        raise UnsupportedArchError(ELSEWHERE[model_type])
    raise UnsupportedArchError(
        f"model_type {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())}."
    )


_CACHE_KINDS = {"gqa": "KV (per position)", "gated_gqa": "KV (per position)",
                "gated_deltanet": "recurrent state (fixed size)", "mla": "latent (compressed kv + rope key per position)",
                "sink_gqa": "KV (per position)", "sink_swa": "KV ring (window positions)",
                "gemma_gqa": "KV (per position)", "gemma_swa": "KV ring (window positions)"}
_MIXER_NAMES = {"gqa": "GQA", "gated_gqa": "gated GQA", "gated_deltanet": "Gated DeltaNet", "mla": "MLA",
                "sink_gqa": "GQA + sinks", "sink_swa": "sliding-window GQA + sinks",
                "gemma_gqa": "global GQA (wide heads, k=v, proportional rope)", "gemma_swa": "sliding-window GQA"}
_ROUTER_KINDS = {"softmax_topk": "softmax → top-k (renorm per config)", "topk_softmax": "top-k → softmax",
                 "sigmoid_grouped": "sigmoid + bias → group-limited top-k, scaled",
                 "softmax_grouped": "softmax → (group-limited) top-k, scaled",
                 "scaled_softmax_topk": "normed input → softmax → top-k (renorm) × per-expert scale"}


def describe_archs() -> list[dict[str, str]]:
    """One row per family for `moestream archs`."""
    rows = []
    for spec in ARCHS.values():
        norm = {"none": "", "per_head": " + per-head q/k norm", "full": " + full q/k norm"}[spec.qk_norm]
        if spec.qk_norm_switch is not None:
            norm = f"{norm} if {spec.qk_norm_switch}"
        mixers = list(dict.fromkeys(spec.layer_mixers.values())) or [spec.mixer]   # hybrids: every kind
        attention = " / ".join(_MIXER_NAMES[m] for m in mixers)
        attention += (" + partial rotary" if spec.partial_rotary else "") + norm
        cache = " + ".join(dict.fromkeys(_CACHE_KINDS[m] for m in mixers))
        router = _ROUTER_KINDS[spec.router] + (" (logits with a bias)" if spec.router_bias else "")
        shared = "yes, sigmoid-gated" if spec.shared_expert_gate else ("yes" if spec.shared_expert else "no")
        rows.append({"arch": spec.name, "model types": ", ".join(spec.model_types), "router": router,
                     "attention": attention, "cache": cache, "shared experts": shared})
    return rows


__all__ = ["ARCHS", "ArchSpec", "ModelConfig", "RopeConfig", "describe_archs", "detect_arch",
           "model_config_from_hf", "supported_model_types"]
