"""Tensors are read as what they are: a weight stored as an integer type is refused by name, and a
tensor present in two shards (without an index to say which) is an error naming it."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import moestream
from moestream.errors import CheckpointError


def _copy(src, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(src, folder)
    return folder


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight",
                                  "model.embed_tokens.weight"])
def test_an_integer_weight_is_refused_by_name(tiny_qwen3, tmp_path, name):
    folder = _copy(tiny_qwen3, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name] = torch.zeros(tensors[name].shape, dtype=torch.int8)   # same shape, other dtype
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{name}' is stored as int8"):
        moestream.load(folder, device="cpu", dtype="float32")


def test_a_tensor_in_two_shards_without_an_index_is_named(tiny_qwen3, tmp_path):
    folder = _copy(tiny_qwen3, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(folder / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is in both"):
        moestream.load(folder, device="cpu", dtype="float32")
