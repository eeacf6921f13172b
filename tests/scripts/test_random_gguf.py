"""benchmarks/random_gguf.py writes the GGUF llama.cpp runs beside us: every type it offers is one
moestream reads back in the format llama.cpp's file type stands for (the experts of MXFP4_MOE in
MXFP4, the other matrices Q8_0), and a qwen3next file holds exactly the tensors, shapes, types and
keys llama.cpp's loader asks for (it cannot be run here: the tables below are read from its source)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import pytest

import moestream
from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32,
          "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "max_position_embeddings": 512}
# Qwen3-Next's structure, tiny: 2 key heads of 2 value heads each, key and value heads as wide (llama.cpp
# sizes both from ssm.state_size), every 4th of 5 layers full attention; a width of 256 so Q4_0's output
# matrix takes Q6_K, 8 experts so llama-quantize's 8-expert rule shows
NEXT = {"model_type": "qwen3_next", "vocab_size": 256, "hidden_size": 256, "moe_intermediate_size": 32,
        "intermediate_size": 128, "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 5,
        "max_position_embeddings": 512, "full_attention_interval": 4, "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000000,
        "tie_word_embeddings": False}


def write(tmp_path: Path, config: dict, qtype: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / f"{qtype}.gguf"
    run = run_script(ROOT / "benchmarks" / "random_gguf.py", str(out), "--config", str(tmp_path / "config.json"),
                     "--qtype", qtype, "--threads", "2", timeout=120)
    return run, out


@pytest.mark.parametrize("qtype,experts,attention", [("mxfp4", "mxfp4", "QuantLinear"), ("q4_0", "int4-g32", "QuantLinear"),
                                                     ("bf16", "fp32", "Linear")])
def test_each_type_reads_back_as_the_file_type_says(tmp_path, qtype, experts, attention):
    run, out = write(tmp_path, CONFIG, qtype)
    assert run.returncode == 0, run.stderr
    engine = moestream.load(str(out), device="cpu", dtype="float32")
    assert {f.name for f in engine.bank.formats.values()} == {experts}
    assert type(engine.model.model.layers[0].self_attn.q_proj).__name__ == attention
    assert len(engine.generate([3, 4, 5], max_tokens=4, ignore_eos=True)) == 4
    # its vocabulary spells any text (a byte token for each character here), so `run -p TEXT` works on it
    text = "def f(x):\n    return 42 + x"
    ids = engine.tokenizer.encode(text)
    assert len(ids) == len(text) and engine.tokenizer.decode(ids) == text
    assert engine.tokenizer.encode("ab") == [255]   # the one merge


@pytest.mark.parametrize("qtype,experts,attention", [("bf16", "fp32", "Linear"), ("q8_0", "int8-g32", "QuantLinear"),
                                                     ("q4_0", "int4-g32", "QuantLinear"),
                                                     ("mxfp4", "mxfp4", "QuantLinear")])
def test_qwen3next_reads_back_as_qwen3_next(tmp_path, qtype, experts, attention):
    run, out = write(tmp_path, NEXT, qtype)
    assert run.returncode == 0, run.stderr
    engine = moestream.load(str(out), device="cpu", dtype="float32")
    assert engine.model.config.layer_mixers == ("gated_deltanet",) * 3 + ("gated_gqa", "gated_deltanet")
    assert {f.name for f in engine.bank.formats.values()} == {experts}
    layers = engine.model.model.layers
    assert type(layers[0].linear_attn.in_proj_qkvz).__name__ == attention
    assert type(layers[3].self_attn.q_proj).__name__ == attention
    assert len(engine.generate([3, 4, 5], max_tokens=4, ignore_eos=True)) == 4


def llama_cpp_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's loader creates for a qwen3next GGUF of config `c` (none optional
    that a current conversion writes; legacy ssm_in and the fused gate_up/qkv forms not written),
    with its ggml shape (ne: the row width first), read from llama_model_qwen3next::load_arch_hparams
    and ::load_arch_tensors (src/models/qwen3next.cpp) and llama_model_base::create_tensor_qkv /
    create_tensor_gate_up_exps (src/llama-model.cpp)."""
    n_embd, n_vocab, n_expert = c["hidden_size"], c["vocab_size"], c["num_experts"]
    n_head, n_head_kv, n_embd_head_k = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    n_ff_exp, n_ff_shexp = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    head_k_dim = head_v_dim = c["linear_key_head_dim"]          # both hparams.ssm_d_state
    n_k_heads, n_v_heads = c["linear_num_key_heads"], c["linear_num_value_heads"]   # ssm_n_group, ssm_dt_rank
    key_dim, value_dim = head_k_dim * n_k_heads, head_v_dim * n_v_heads
    conv_dim, ba_dim = key_dim * 2 + value_dim, n_v_heads * 2
    t = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,), "output.weight": (n_embd, n_vocab)}
    for il in range(c["num_hidden_layers"]):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = t[p + "post_attention_norm.weight"] = (n_embd,)
        if (il + 1) % c.get("full_attention_interval", 4) == 0:   # is_recr false: attention
            t[p + "attn_q.weight"] = (n_embd, n_embd_head_k * n_head * 2)
            t[p + "attn_k.weight"] = t[p + "attn_v.weight"] = (n_embd, n_embd_head_k * n_head_kv)
            t[p + "attn_output.weight"] = (n_embd_head_k * n_head, n_embd)
            t[p + "attn_q_norm.weight"] = t[p + "attn_k_norm.weight"] = (n_embd_head_k,)
        else:
            t[p + "attn_qkv.weight"] = (n_embd, key_dim * 2 + value_dim)
            t[p + "attn_gate.weight"] = (n_embd, value_dim)
            t[p + "ssm_conv1d.weight"] = (c["linear_conv_kernel_dim"], conv_dim)
            t[p + "ssm_dt.bias"] = t[p + "ssm_a"] = (n_v_heads,)
            t[p + "ssm_ba.weight"] = (n_embd, ba_dim)
            t[p + "ssm_norm.weight"] = (head_v_dim,)
            t[p + "ssm_out.weight"] = (value_dim, n_embd)
        t[p + "ffn_gate_inp.weight"] = (n_embd, n_expert)
        t[p + "ffn_down_exps.weight"] = (n_ff_exp, n_embd, n_expert)
        t[p + "ffn_gate_exps.weight"] = t[p + "ffn_up_exps.weight"] = (n_embd, n_ff_exp, n_expert)
        t[p + "ffn_gate_inp_shexp.weight"] = (n_embd,)
        t[p + "ffn_gate_shexp.weight"] = t[p + "ffn_up_shexp.weight"] = (n_embd, n_ff_shexp)
        t[p + "ffn_down_shexp.weight"] = (n_ff_shexp, n_embd)
    return t


# The ggml type of each tensor in each file type for NEXT: the converter's BF16 file (ModelBase.prepare_tensors:
# 1-D tensors, norms, non-.weight tensors, FFN_GATE_INP, FFN_GATE_INP_SHEXP and SSM_CONV1D F32), then
# llama-quantize's default mix (src/llama-quant.cpp: tensor_allows_quantization leaves < 2-D tensors, norms,
# ffn_gate_inp and ssm_conv1d as they are; llama_tensor_get_type_impl makes a Q4_0 file's output Q6_K, keeps
# attn_k / attn_v / attn_qkv Q8_0 for 8 experts, and MXFP4_MOE's 3-D expert stacks MXFP4, every other matrix Q8_0)
F32 = ("_norm.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
TYPES = {
    "bf16": {"": "BF16"},
    "q8_0": {"": "Q8_0"},
    "q4_0": {"": "Q4_0", "output.weight": "Q6_K", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0",
             "attn_qkv.weight": "Q8_0"},
    "mxfp4": {"": "Q8_0", "ffn_gate_exps.weight": "MXFP4", "ffn_up_exps.weight": "MXFP4", "ffn_down_exps.weight": "MXFP4"},
}


def expected_type(name: str, qtype: str) -> str:
    """The type TYPES gives tensor `name` (looked up without its `blk.N.`; "": every other matrix)."""
    if name.endswith(F32):
        return "F32"
    table = TYPES[qtype]
    return table.get(name.split(".", 2)[2] if name.startswith("blk.") else name, table[""])


@pytest.mark.parametrize("qtype", ["bf16", "q8_0", "q4_0", "mxfp4"])
def test_qwen3next_holds_what_llama_cpp_loads(tmp_path, qtype):
    run, out = write(tmp_path, NEXT, qtype)
    assert run.returncode == 0, run.stderr
    reader = gguf.GGUFReader(out)
    found = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name) for t in reader.tensors}
    wanted = llama_cpp_tensors(NEXT)
    assert sorted(found) == sorted(wanted)   # llama.cpp refuses a file with a tensor it does not load, too
    for name, ne in wanted.items():   # llama_model_loader::check_tensor_dims: the dims asked for, then only 1s
        shape = found[name][0]
        assert shape[:len(ne)] == ne and all(n == 1 for n in shape[len(ne):]), (name, shape, ne)
    assert {name: kind for name, (_, kind) in found.items()} == {name: expected_type(name, qtype) for name in found}
    keys = {k: reader.fields[k].contents() for k in reader.fields}
    assert keys["general.architecture"] == "qwen3next"
    assert keys["general.file_type"] == {"bf16": 32, "q8_0": 7, "q4_0": 2, "mxfp4": 38}[qtype]
    want = {"block_count": 5, "context_length": 512, "embedding_length": 256, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 32, "attention.value_length": 32,
            "attention.layer_norm_rms_epsilon": pytest.approx(1e-6), "expert_count": 8, "expert_used_count": 2,
            "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 64,
            "ssm.conv_kernel": 4, "ssm.state_size": 32, "ssm.group_count": 2, "ssm.time_step_rank": 4,
            "ssm.inner_size": 128, "full_attention_interval": 4, "rope.dimension_count": 8,
            "rope.freq_base": pytest.approx(1e7)}
    assert {k: keys[f"qwen3next.{k}"] for k in want} == want
    assert len(keys["tokenizer.ggml.tokens"]) == 256


@pytest.mark.parametrize("change,words", [({"linear_value_head_dim": 16}, "ssm.state_size"),
                                          ({"layer_types": ["linear_attention", "full_attention"] * 2
                                            + ["linear_attention"]}, "full_attention_interval"),
                                          ({"model_type": "mixtral"}, "only qwen3_moe and qwen3_next"),
                                          ({"linear_conv_kernel_dim": None}, "lacks linear_conv_kernel_dim")])
def test_a_shape_llama_cpp_has_no_gguf_for_is_refused_in_one_line(tmp_path, change, words):
    config = {k: v for k, v in {**NEXT, **change}.items() if v is not None}
    run, out = write(tmp_path, config, "q8_0")
    assert run.returncode == 1 and not out.exists() and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and words in run.stderr


@pytest.mark.parametrize("config,qtype", [(CONFIG, "q4_0"), (CONFIG, "bf16"), (NEXT, "q8_0")],
                         ids=["qwen3moe-q4_0", "qwen3moe-bf16", "qwen3next-q8_0"])
def test_token_routing_zeroes_the_routed_dimensions_everywhere_but_the_embedding(tmp_path, config, qtype):
    """--token-routing: every router reads only the first routed dimensions, every projection into the
    residual (of each expert, too) leaves them zero, and the token embedding fills them: each layer's
    experts are then a function of the token alone, in llama.cpp as in moestream."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "t.gguf"
    run = run_script(ROOT / "benchmarks" / "random_gguf.py", str(out), "--config", str(tmp_path / "config.json"),
                     "--qtype", qtype, "--threads", "2", "--token-routing", timeout=120)
    assert run.returncode == 0, run.stderr
    routed = min(64, config["hidden_size"] // 4)
    H = config["hidden_size"]
    seen = set()
    for t in gguf.GGUFReader(out).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(*reversed([int(n) for n in t.shape]))
        kind = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        if kind == "ffn_gate_inp.weight":
            assert (w[:, routed:] == 0).all() and (w[:, :routed] != 0).mean() > 0.9
        elif kind in ("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight"):
            rows = w.reshape(-1, H, w.shape[-1])
            assert (rows[:, :routed] == 0).all() and (rows[:, routed:] != 0).mean() > 0.5
        elif kind == "token_embd.weight":
            assert (w[:, :routed] != 0).mean() > 0.9
        else:
            continue
        seen.add(kind)
    assert {"ffn_gate_inp.weight", "ffn_down_exps.weight", "token_embd.weight"} <= seen
    assert ("ssm_out.weight" in seen) == (config is NEXT)
    engine = moestream.load(str(out), device="cpu", dtype="float32")   # and it is still a model we run
    assert len(engine.generate([3, 4, 5], max_tokens=4, ignore_eos=True)) == 4
