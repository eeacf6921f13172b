"""DeepSeek-V2 / V3 and GLM-4.7-Flash config.json reading: the MLA sizes, the softmax scale and the
layer pattern as transformers derives them, and every variant moestream does not run refused in one
sentence before any tensor exists."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

import moestream
from moestream.archs import ARCHS, detect_arch, model_config_from_hf
from moestream.errors import CheckpointError

BASE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 16, "n_routed_experts": 16,
        "num_experts_per_tok": 2}
CLASSES = {"deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config,
           "glm4_moe_lite": transformers.Glm4MoeLiteConfig}


def _read(arch: str, **overrides):
    raw = {"model_type": arch, **BASE, **overrides}
    return model_config_from_hf(raw, detect_arch(raw))


@pytest.mark.parametrize("arch", list(CLASSES))
def test_defaults_are_transformers_defaults(arch):
    """A config.json that leaves the MLA and routing keys out reads as transformers' config class fills them."""
    ours = _read(arch)
    theirs = CLASSES[arch](**BASE)
    mla = ours.latent_attention
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        theirs.q_lora_rank, theirs.kv_lora_rank, theirs.qk_nope_head_dim, theirs.qk_rope_head_dim, theirs.v_head_dim)
    assert mla.rope_interleave is getattr(theirs, "rope_interleave", True)
    assert ours.head_dim == theirs.qk_nope_head_dim + theirs.qk_rope_head_dim
    assert ours.rotary_dim == theirs.qk_rope_head_dim and ours.num_kv_heads == ours.num_heads
    assert ours.shared_intermediate == theirs.n_shared_experts * theirs.moe_intermediate_size
    assert ours.routed_scaling_factor == theirs.routed_scaling_factor
    assert ours.norm_topk_prob == bool(theirs.norm_topk_prob) and ours.rms_norm_eps == theirs.rms_norm_eps
    dense = (theirs.mlp_layer_types if arch == "glm4_moe_lite"
             else ["dense" if i < theirs.first_k_dense_replace else "sparse" for i in range(4)])
    assert ours.moe_layers == tuple(t == "sparse" for t in dense)


def test_explicit_null_q_lora_rank_is_a_plain_q_proj():
    """DeepSeek-V2-Lite writes "q_lora_rank": null; the default (1536) applies only where the key is absent."""
    assert _read("deepseek_v2", q_lora_rank=None).latent_attention.q_lora_rank is None
    assert _read("deepseek_v2").latent_attention.q_lora_rank == 1536
    assert _read("deepseek_v3", q_lora_rank=24).latent_attention.q_lora_rank == 24


def test_config_head_dim_is_the_rope_part_not_the_head():
    """transformers saves head_dim = qk_rope_head_dim for these families; a q/k head is nope + rope wide."""
    config = _read("deepseek_v3", head_dim=4, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10)
    assert config.head_dim == 12 and config.rotary_dim == 4 and config.latent_attention.v_head_dim == 10


def test_deepseek_v2_groups_apply_only_to_group_limited_greedy():
    greedy = _read("deepseek_v2", topk_method="greedy", n_group=4, topk_group=2)
    limited = _read("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    assert (greedy.n_group, greedy.topk_group) == (1, 1)
    assert (limited.n_group, limited.topk_group) == (4, 2)
    # V2 scores a group by its best expert: groups of one expert are valid there (V3 needs two)
    assert _read("deepseek_v2", topk_method="group_limited_greedy", n_group=16, topk_group=4).n_group == 16
    with pytest.raises(CheckpointError, match="best two experts"):
        _read("deepseek_v3", n_group=16, topk_group=4)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 64,
     "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},    # DeepSeek-V2's
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
     "mscale": 1.0, "mscale_all_dim": 0.8},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64},   # no mscale
    {"rope_type": "default", "rope_theta": 1e4},
])
@pytest.mark.parametrize("arch", list(CLASSES))
def test_softmax_scale_equals_transformers(arch, rope):
    from importlib import import_module

    modeling = import_module(f"transformers.models.{arch}.modeling_{arch}")
    attention = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("Attention") and "Latent" not in n)
    sizes = dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10)
    theirs = attention(CLASSES[arch](**BASE, **sizes, max_position_embeddings=256, rope_parameters=rope), 0)
    ours = _read(arch, **sizes, max_position_embeddings=256, rope_parameters=rope).latent_attention
    assert ours.softmax_scale == theirs.scaling


def test_older_rope_scaling_spelling_reads_the_same():
    """DeepSeek-V2's published config.json: rope_scaling with "type": "yarn" and a top-level rope_theta."""
    rope = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    old = _read("deepseek_v2", rope_theta=1e4, rope_scaling=rope, max_position_embeddings=163840)
    new = _read("deepseek_v2", max_position_embeddings=163840,
                rope_parameters={**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "yarn",
                                 "rope_theta": 1e4})
    assert old.rope == new.rope and old.latent_attention == new.latent_attention
    assert old.latent_attention.softmax_scale > 192 ** -0.5


BAD = [
    ("deepseek_v2", "topk_method", "noaux_tc", "does not implement"),
    ("deepseek_v2", "scoring_func", "sigmoid", "does not implement"),
    ("deepseek_v2", "norm_topk_prob", True, "does not implement"),
    ("deepseek_v2", "moe_layer_freq", 2, "does not implement"),
    ("deepseek_v2", "mlp_bias", True, "does not implement"),
    ("deepseek_v3", "topk_method", "group_limited_greedy", "does not implement"),
    ("deepseek_v3", "scoring_func", "softmax", "does not implement"),
    ("deepseek_v3", "hidden_act", "gelu", "does not implement"),
    ("glm4_moe_lite", "topk_method", "greedy", "does not implement"),
    ("glm4_moe_lite", "scoring_func", "softmax", "does not implement"),
    ("deepseek_v3", "num_key_value_heads", 2, "must equal num_attention_heads"),
    ("deepseek_v3", "qk_rope_head_dim", 5, "must be even"),
    ("deepseek_v3", "qk_rope_head_dim", 0, "qk_rope_head_dim"),
    ("deepseek_v3", "kv_lora_rank", 0, "kv_lora_rank"),
    ("deepseek_v3", "q_lora_rank", -1, "q_lora_rank"),
    ("deepseek_v3", "v_head_dim", "128", "v_head_dim"),
    ("deepseek_v3", "rope_interleave", 1, "rope_interleave"),
    ("deepseek_v3", "partial_rotary_factor", 0.5, "rotates the whole rope key"),
    ("glm4_moe_lite", "mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types"),
    ("glm4_moe_lite", "mlp_layer_types", ["dense", "sparse"], "mlp_layer_types"),
    ("glm4_moe_lite", "mlp_layer_types", ["dense", "dense", "dense"], "not a Mixture-of-Experts model"),
]


@pytest.mark.parametrize("arch,key,value,match", BAD)
def test_bad_values_are_refused_before_loading(tiny_checkpoints, tmp_path, arch, key, value, match):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints[arch][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match) as info:
        moestream.load(folder, device="cpu")
    assert str(info.value).count(". ") == 0 and str(info.value).endswith(".")   # one sentence


def test_glm4_moe_lite_reads_first_k_dense_replace_as_transformers_does():
    """transformers' Glm4MoeLite builds its layers from mlp_layer_types only (default: layer 0 dense)."""
    assert _read("glm4_moe_lite", first_k_dense_replace=2).moe_layers == (False, True, True, True)
    assert _read("glm4_moe_lite", mlp_layer_types=["sparse", "dense", "dense", "sparse"]).moe_layers == (
        True, False, False, True)
    assert ARCHS["glm4_moe_lite"].mixer == "mla"
