"""Every config.json value is checked (type, range, combination) before any tensor exists; `check`
applies the same checks. One sentence naming the key, exit 1."""

import json
import shutil

import pytest

import moestream
from moestream.cli import main as cli_main
from moestream.errors import CheckpointError

BAD = [
    ("vocab_size", -5, "vocab_size"), ("vocab_size", 0, "vocab_size"), ("vocab_size", "160", "vocab_size"),
    ("num_hidden_layers", 0, "num_hidden_layers"), ("num_hidden_layers", 2.5, "num_hidden_layers"),
    ("hidden_size", -32, "hidden_size"), ("head_dim", 0, "head_dim"), ("num_attention_heads", True, "num_attention_heads"),
    ("num_experts", [8], "num_experts"), ("num_experts_per_tok", 0, "num_experts_per_tok"),
    ("num_experts_per_tok", 9, "routes 9 of 8"), ("num_key_value_heads", 3, "must divide"),
    ("moe_intermediate_size", -1, "moe_intermediate_size"), ("rms_norm_eps", 0, "rms_norm_eps"),
    ("rms_norm_eps", "small", "rms_norm_eps"), ("max_position_embeddings", 1, "max_position_embeddings"),
    ("eos_token_id", -1, "eos_token_id"), ("eos_token_id", [1, 999], "eos_token_id"), ("eos_token_id", "1", "eos_token_id"),
    ("mlp_only_layers", [7], "mlp_only_layers"), ("mlp_only_layers", "1", "mlp_only_layers"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"), ("norm_topk_prob", "yes", "norm_topk_prob"),
    ("tie_word_embeddings", 1, "tie_word_embeddings"), ("rope_theta", -1, "rope_theta"),
    ("rope_parameters", [1], "rope_parameters"),
]


def _edited(src, tmp_path, key, value):
    folder = tmp_path / "ckpt"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    if key == "rope_theta":
        config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("key,value,match", BAD)
def test_bad_config_values_are_named_before_loading(tiny_qwen3, tmp_path, key, value, match):
    folder = _edited(tiny_qwen3, tmp_path, key, value)
    with pytest.raises(CheckpointError, match=match):
        moestream.load(folder, device="cpu")


@pytest.mark.parametrize("key,value,match", BAD[::4])
def test_check_applies_the_same_validation(tiny_qwen3, tmp_path, capsys, key, value, match):
    folder = _edited(tiny_qwen3, tmp_path, key, value)
    (folder / "model.safetensors").unlink()   # check never reads weights
    assert cli_main(["check", str(folder), "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("moestream: error:") and err.count("\n") == 1 and match in err
