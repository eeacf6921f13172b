"""Qwen3-Next's config.json (and Qwen3.5-MoE's text-only one): the layer pattern, Gated DeltaNet sizes
and partial rotary, each checked with a one-sentence error before any tensor exists."""

from __future__ import annotations

import json
import shutil

import pytest

import moestream
from moestream.archs import ARCHS, detect_arch, model_config_from_hf
from moestream.errors import CheckpointError, UnsupportedArchError

SPEC = ARCHS["qwen3_next"]


@pytest.fixture(scope="module")
def raw(tiny_checkpoints) -> dict:
    return json.loads((tiny_checkpoints["qwen3_next"][0] / "config.json").read_text())


def test_layer_types_choose_the_mixer_of_each_layer(raw):
    config = model_config_from_hf(raw, SPEC)
    assert config.layer_mixers == ("gated_deltanet",) * 3 + ("gated_gqa",)
    lin = config.linear_attention
    assert (lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim, lin.conv_kernel) == (2, 4, 8, 8, 4)
    assert config.rotary_dim == 4 and config.shared_intermediate == 24 and config.norm_topk_prob


def test_without_layer_types_every_interval_th_layer_is_full_attention(raw):
    edited = {k: v for k, v in raw.items() if k != "layer_types"}
    assert model_config_from_hf(edited, SPEC).layer_mixers == ("gated_deltanet",) * 3 + ("gated_gqa",)
    edited["full_attention_interval"] = 2
    assert model_config_from_hf(edited, SPEC).layer_mixers == ("gated_deltanet", "gated_gqa") * 2


def test_the_older_top_level_partial_rotary_factor_is_read(raw):
    edited = {**raw, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "partial_rotary_factor": 0.5}
    assert model_config_from_hf(edited, SPEC).rotary_dim == 8
    edited.pop("partial_rotary_factor")
    assert model_config_from_hf(edited, SPEC).rotary_dim == 4   # transformers' default: a quarter


BAD = [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "layer 1 a 'sliding_attention' layer"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "one layer type for each of its 4 layers"),
    ({"layer_types": "linear_attention"}, "layer_types"),
    ({"layer_types": None, "full_attention_interval": 0}, "full_attention_interval"),
    ({"linear_num_value_heads": 3}, "the key heads must divide the value heads"),
    ({"linear_num_key_heads": 0}, "linear_num_key_heads"),
    ({"linear_conv_kernel_dim": 2.5}, "linear_conv_kernel_dim"),
    ({"linear_key_head_dim": "8"}, "linear_key_head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
]


@pytest.mark.parametrize("change,match", BAD)
def test_bad_values_are_named(raw, change, match):
    with pytest.raises(CheckpointError, match=match):
        model_config_from_hf({**raw, **change}, SPEC)


def test_an_unknown_layer_type_stops_loading_with_one_sentence(tiny_checkpoints, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["qwen3_next"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"][2] = "mamba"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        moestream.load(folder, device="cpu")
    message = str(err.value)
    assert "'mamba'" in message and "layer 2" in message and "linear_attention, full_attention" in message
    assert message.count(". ") == 0 and message.endswith(".")


def test_qwen3_5_moe_text_is_the_same_hybrid_with_split_projections(tiny_checkpoints):
    raw = json.loads((tiny_checkpoints["qwen3_5_moe"][0] / "config.json").read_text())
    spec = detect_arch(raw)
    assert spec.name == "qwen3_5_moe" and spec.linear_projections == "split"
    config = model_config_from_hf({**raw, "norm_topk_prob": False}, spec)
    assert config.layer_mixers == ("gated_deltanet",) * 3 + ("gated_gqa",)
    assert config.norm_topk_prob   # transformers renormalises Qwen3.5's top-k whatever the config says
    assert config.rotary_dim == 4 and all(config.moe_layers)
    with pytest.raises(UnsupportedArchError, match="qwen3_5_moe_text"):   # the vision-language wrapper
        detect_arch({**raw, "model_type": "qwen3_5_moe"})
