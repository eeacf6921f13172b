"""benchmarks/random_gguf.py writes the GGUF llama.cpp runs beside us: every type it offers is one
moestream reads back in the format llama.cpp's file type stands for (the experts of MXFP4_MOE in
MXFP4, the other matrices Q8_0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import moestream

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32,
          "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "max_position_embeddings": 512}


@pytest.mark.parametrize("qtype,experts,attention", [("mxfp4", "mxfp4", "QuantLinear"), ("q4_0", "int4-g32", "QuantLinear"),
                                                     ("bf16", "fp32", "Linear")])
def test_each_type_reads_back_as_the_file_type_says(tmp_path, qtype, experts, attention):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / f"{qtype}.gguf"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "random_gguf.py"), str(out), "--config",
                          str(tmp_path / "config.json"), "--qtype", qtype], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    engine = moestream.load(str(out), device="cpu", dtype="float32")
    assert {f.name for f in engine.bank.formats.values()} == {experts}
    assert type(engine.model.model.layers[0].self_attn.q_proj).__name__ == attention
    assert len(engine.generate([3, 4, 5], max_tokens=4, ignore_eos=True)) == 4
