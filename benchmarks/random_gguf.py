"""Write a random-weight qwen3moe GGUF of the same shape as a random moestream checkpoint, so llama.cpp
runs beside moestream on the same shape.

The shape comes from the checkpoint's config.json (`scripts/make_random_checkpoint.py --shape
qwen3-30b-a3b --layers 24` writes one). Weights are BF16, Q8_0 or Q4_0 (every matrix, as a real
quantized GGUF holds them), or MXFP4_MOE (`--qtype mxfp4`: the experts MXFP4, the other matrices
Q8_0, as llama-quantize makes it); norms and routers F32. Decode speed depends on the shape and the format,
not the values. Needs the `gguf` package (`pip install gguf`, or llama.cpp's own: PYTHONPATH=LLAMA_CPP/gguf-py).

    python benchmarks/random_gguf.py /tmp/q3-bf16.gguf --config /tmp/q3/config.json --qtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

QTYPES = {"bf16": 32, "q8_0": 7, "q4_0": 2, "mxfp4": 38}   # the GGUF file type of each (mxfp4: MXFP4_MOE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", type=Path, required=True, help="config.json of the qwen3_moe checkpoint to match")
    ap.add_argument("--qtype", choices=list(QTYPES), default="q4_0")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        import gguf
    except ImportError:
        print("random_gguf: error: the gguf package is missing; `pip install gguf` or set PYTHONPATH to llama.cpp's "
              "gguf-py folder.", file=sys.stderr)
        return 1
    c = json.loads(a.config.read_text())
    if c.get("model_type") != "qwen3_moe":
        print(f"random_gguf: error: {a.config} is a {c.get('model_type')!r} checkpoint; only qwen3_moe shapes have "
              "a GGUF writer here.", file=sys.stderr)
        return 1
    V, H, I, E, K = c["vocab_size"], c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["num_experts_per_tok"]
    NH, NKV = c["num_attention_heads"], c["num_key_value_heads"]
    HD = c.get("head_dim") or H // NH
    L = c["num_hidden_layers"]
    types = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "bf16": gguf.GGMLQuantizationType.BF16, "mxfp4": gguf.GGMLQuantizationType.MXFP4}
    # MXFP4_MOE, as llama-quantize makes it: the experts MXFP4, every other matrix Q8_0
    qt = types["q8_0" if a.qtype == "mxfp4" else a.qtype]
    qt_experts = types[a.qtype]
    rng = np.random.default_rng(a.seed)

    def weights(*shape: int, kind: gguf.GGMLQuantizationType = qt) -> np.ndarray:   # the last dimension a row's
        if kind == gguf.GGMLQuantizationType.BF16:   # raw bf16 bits: random sign and mantissa, exponent 2^-7
            r = rng.bit_generator.random_raw(int(np.prod(shape)) // 4).view(np.uint16)
            r &= 0x807F
            r |= 0x3C00
            return r.reshape(shape)
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]   # weights per block, bytes per block
        *lead, cols = shape
        blocks = rng.integers(0, 256, size=(int(np.prod(lead)) * cols // block, block_bytes), dtype=np.uint8)
        if kind == gguf.GGMLQuantizationType.MXFP4:   # one e8m0 scale byte: 2^-9 times fp4 codes up to 6
            blocks[:, 0] = 127 - 9
        else:   # one fp16 scale: codes in [-8, 7] (q4_0) or [-128, 127] (q8_0) give |w| up to ~0.02
            d = 0.02 / (8 if kind == gguf.GGMLQuantizationType.Q4_0 else 128)
            blocks[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
        return blocks.reshape(*lead, cols // block * block_bytes)

    partial = a.out.with_name(a.out.name + ".partial")   # a run cut short leaves no file that looks whole
    w = gguf.GGUFWriter(str(partial), "qwen3moe")
    w.add_block_count(L)
    w.add_context_length(c.get("max_position_embeddings", 40960))
    w.add_embedding_length(H)
    w.add_feed_forward_length(c.get("intermediate_size", 4 * H))
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(float(c.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(I)
    w.add_file_type(QTYPES[a.qtype])
    # A byte-level BPE vocabulary with one merge, as Qwen3's GGUFs hold theirs (read by both engines).
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b", "ab"] + [f"<t{i}>" for i in range(6, V)])
    w.add_token_types([2, 3, 3] + [1] * (V - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, arr: np.ndarray, quantized: bool = True, kind: gguf.GGMLQuantizationType = qt) -> None:
        w.add_tensor(name, arr, raw_dtype=kind if quantized else None)

    ones = lambda n: np.ones(n, np.float32)   # noqa: E731
    add("token_embd.weight", weights(V, H))
    add("output.weight", weights(V, H))
    add("output_norm.weight", ones(H), False)
    for layer in range(L):
        p = f"blk.{layer}."
        add(p + "attn_norm.weight", ones(H), False)
        add(p + "ffn_norm.weight", ones(H), False)
        add(p + "attn_q.weight", weights(NH * HD, H))
        add(p + "attn_k.weight", weights(NKV * HD, H))
        add(p + "attn_v.weight", weights(NKV * HD, H))
        add(p + "attn_output.weight", weights(H, NH * HD))
        add(p + "attn_q_norm.weight", ones(HD), False)
        add(p + "attn_k_norm.weight", ones(HD), False)
        add(p + "ffn_gate_inp.weight", rng.standard_normal((E, H), dtype=np.float32) * 0.02, False)
        for proj, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
            add(p + f"ffn_{proj}_exps.weight", weights(*shape, kind=qt_experts), kind=qt_experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(partial, a.out)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
