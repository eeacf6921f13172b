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


# glm4_moe's keys on its tiny checkpoint: 8 experts in n_group 2 with topk_group 1, top-2, head_dim 16,
# 3 layers with first_k_dense_replace 1.
GLM_BAD = [
    ("n_group", 0, "n_group"), ("n_group", 2.5, "n_group"), ("n_group", 3, "does not divide them evenly"),
    ("n_group", 8, "best two experts"), ("topk_group", 3, "topk_group must not exceed n_group"),
    ("topk_group", "1", "topk_group"), ("num_experts_per_tok", 5, "from topk_group = 1 groups of 4"),
    ("routed_scaling_factor", 0, "routed_scaling_factor"), ("routed_scaling_factor", "2.5", "routed_scaling_factor"),
    ("n_shared_experts", -1, "n_shared_experts"), ("first_k_dense_replace", -1, "first_k_dense_replace"),
    ("first_k_dense_replace", 3, "not a Mixture-of-Experts model"), ("use_qk_norm", 1, "use_qk_norm"),
    ("partial_rotary_factor", 0, "partial_rotary_factor"), ("partial_rotary_factor", 1.5, "<= 1"),
    ("partial_rotary_factor", 0.1, "even number"), ("attention_bias", "yes", "attention_bias"),
    ("topk_method", "greedy", "does not implement"), ("scoring_func", "softmax", "does not implement"),
    ("hidden_act", "gelu", "does not implement"),
]


@pytest.mark.parametrize("key,value,match", GLM_BAD)
def test_bad_glm4_moe_values_are_named_before_loading(tiny_checkpoints, tmp_path, key, value, match):
    folder = _edited(tiny_checkpoints["glm4_moe"][0], tmp_path, key, value)
    if key == "partial_rotary_factor":   # the top-level spelling counts only where rope_parameters has none
        config = json.loads((folder / "config.json").read_text())
        del config["rope_parameters"]["partial_rotary_factor"]
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match) as info:
        moestream.load(folder, device="cpu")
    assert str(info.value).count(". ") == 0 and str(info.value).endswith(".")   # one sentence


def test_glm4_moe_config_reads_what_transformers_reads():
    """Switches and defaults as transformers' Glm4MoeConfig applies them, in both config layouts."""
    from moestream.archs import ARCHS, model_config_from_hf

    base = {"model_type": "glm4_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
            "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2}
    spec = ARCHS["glm4_moe"]
    defaults = model_config_from_hf(base, spec)
    assert defaults.rotary_dim == 8 and defaults.qk_norm == "none" and defaults.moe_layers == (False, True, True, True)
    assert defaults.shared_intermediate == 16 and defaults.qkv_bias is False and defaults.o_bias is False
    assert (defaults.n_group, defaults.topk_group, defaults.routed_scaling_factor, defaults.norm_topk_prob) == (
        1, 1, 1.0, True)
    legacy = model_config_from_hf({**base, "partial_rotary_factor": 0.25, "rope_theta": 5e5, "use_qk_norm": True,
                                   "attention_bias": True, "n_shared_experts": 2, "first_k_dense_replace": 2}, spec)
    assert legacy.rotary_dim == 4 and legacy.rope.theta == 5e5 and legacy.qk_norm == "per_head"
    assert legacy.qkv_bias is True and legacy.o_bias is False and legacy.shared_intermediate == 32
    assert legacy.moe_layers == (False, False, True, True) and legacy.rope.extra == ()
    # rope_parameters wins over the top-level key, as in transformers
    both = model_config_from_hf({**base, "partial_rotary_factor": 0.25,
                                 "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.75}}, spec)
    assert both.rotary_dim == 12
