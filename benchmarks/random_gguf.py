"""Write a random-weight qwen3moe or qwen3next GGUF of a random moestream checkpoint's shape.

llama.cpp then runs beside moestream on the same shape: Qwen3-MoE (`qwen3moe`) or Qwen3-Next /
Qwen3-Coder-Next (`qwen3next`).

The shape comes from the checkpoint's config.json (`scripts/make_random_checkpoint.py --shape
qwen3-30b-a3b --layers 24`, or `--shape qwen3-next-80b-a3b`, writes one). The tensors, their shapes
and the metadata are those llama.cpp's convert_hf_to_gguf.py writes for the family; for qwen3next:
each Gated DeltaNet layer's in-projection as attn_qkv + attn_gate, ssm_ba, ssm_conv1d, ssm_a,
ssm_dt.bias, ssm_norm and ssm_out, every `full_attention_interval`-th layer gated attention (attn_q
twice the heads' width: the gate), post_attention_norm, and the shared expert with its sigmoid gate.

Each tensor's type is the one its file type gives it. `--qtype bf16`: as the converter writes it
(matrices BF16; norms, 1-D tensors, the routers, the shared expert's gate and ssm_conv1d F32).
`q8_0`, `q4_0`, `mxfp4` (MXFP4_MOE): as llama-quantize then makes that file (src/llama-quant.cpp):
every `.weight` of 2 or 3 ggml dimensions but norms, routers and ssm_conv1d (the shared expert's
gate, stored (H, 1), has one) in the file type's type, except that
MXFP4_MOE keeps only the expert stacks MXFP4 and the rest Q8_0, the output matrix of a Q4_0 file is
Q6_K (Q8_0 if its rows do not split into 256-blocks), 8-expert models keep attn_k/attn_v/attn_qkv
Q8_0 in Q4_0, and a row that does not split into its type's blocks falls back to F16.

Decode speed depends on the shape and the format, not the values: weights are random valid blocks,
generated on every core (`--threads`) and written tensor by tensor, so the 80B shape's 85 GB in Q8_0
never sits in memory. Needs the `gguf` package (`pip install gguf`, or llama.cpp's own:
PYTHONPATH=LLAMA_CPP/gguf-py).

    python benchmarks/random_gguf.py /tmp/q3-bf16.gguf --config /tmp/q3/config.json --qtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

QTYPES = {"bf16": 32, "q8_0": 7, "q4_0": 2, "mxfp4": 38}   # the GGUF file type of each (mxfp4: MXFP4_MOE)
DEFAULT_TYPE = {"bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "mxfp4": "MXFP4"}   # llama_ftype_get_default_type
ARCH = {"qwen3_moe": "qwen3moe", "qwen3_next": "qwen3next"}
SHARED_FIELDS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                 "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
FIELDS = {"qwen3_moe": SHARED_FIELDS,   # the config.json fields each family's GGUF is sized from
          "qwen3_next": (*SHARED_FIELDS, "shared_expert_intermediate_size", "linear_conv_kernel_dim",
                         "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                         "linear_num_value_heads")}
CHUNK_BYTES = 8 << 20   # one generation task: 8 MB of rows, so every core has work on one expert stack


class ConfigError(ValueError):
    """A config.json of a shape no GGUF has (the message: what is wrong and what to do)."""


@dataclass(frozen=True)
class Spec:
    """One tensor: its GGUF name, numpy shape (rows last: ggml's order reversed) and what fills it:
    "matrix" (random weights in its type), "ones" (norms), "normal" (small random floats, F32),
    "minus_one" (ssm_a = -exp(A_log) for A_log = 0, as the random checkpoint holds)."""
    name: str
    shape: tuple[int, ...]
    fill: str


# ---- the tensors of each family -------------------------------------------------------------------
def _shape_of(c: dict[str, Any]) -> dict[str, int]:
    """The sizes both families share, by llama.cpp's short names."""
    heads = c["num_attention_heads"]
    return {"V": c["vocab_size"], "H": c["hidden_size"], "I": c["moe_intermediate_size"], "E": c["num_experts"],
            "NH": heads, "NKV": c["num_key_value_heads"], "HD": c.get("head_dim") or c["hidden_size"] // heads,
            "L": c["num_hidden_layers"]}


def _top(c: dict[str, Any]) -> list[Spec]:
    s = _shape_of(c)
    specs = [Spec("token_embd.weight", (s["V"], s["H"]), "matrix"), Spec("output_norm.weight", (s["H"],), "ones")]
    if not c.get("tie_word_embeddings", False):   # the converter omits a tied output (llama.cpp reuses token_embd)
        specs.append(Spec("output.weight", (s["V"], s["H"]), "matrix"))
    return specs


def _experts(p: str, s: dict[str, int]) -> list[Spec]:
    E, I, H = s["E"], s["I"], s["H"]
    return [Spec(p + "ffn_gate_inp.weight", (E, H), "normal"),
            Spec(p + "ffn_gate_exps.weight", (E, I, H), "matrix"),
            Spec(p + "ffn_up_exps.weight", (E, I, H), "matrix"),
            Spec(p + "ffn_down_exps.weight", (E, H, I), "matrix")]


def qwen3moe_specs(c: dict[str, Any]) -> list[Spec]:
    s = _shape_of(c)
    H, NH, NKV, HD = s["H"], s["NH"], s["NKV"], s["HD"]
    specs = _top(c)
    for layer in range(s["L"]):
        p = f"blk.{layer}."
        specs += [Spec(p + "attn_norm.weight", (H,), "ones"), Spec(p + "ffn_norm.weight", (H,), "ones"),
                  Spec(p + "attn_q.weight", (NH * HD, H), "matrix"), Spec(p + "attn_k.weight", (NKV * HD, H), "matrix"),
                  Spec(p + "attn_v.weight", (NKV * HD, H), "matrix"), Spec(p + "attn_output.weight", (H, NH * HD), "matrix"),
                  Spec(p + "attn_q_norm.weight", (HD,), "ones"), Spec(p + "attn_k_norm.weight", (HD,), "ones"),
                  *_experts(p, s)]
    return specs


def linear_layers(c: dict[str, Any]) -> list[bool]:
    """Which layers are Gated DeltaNet: every layer but each `full_attention_interval`-th (4 unless
    said), the rule llama.cpp applies to the only key the converter writes for it; a config whose
    `layer_types` say otherwise has no GGUF of that shape."""
    interval = int(c.get("full_attention_interval", 4))
    linear = [(i + 1) % interval != 0 for i in range(c["num_hidden_layers"])]
    types = c.get("layer_types")
    if types and [t == "linear_attention" for t in types[:len(linear)]] != linear:
        raise ConfigError(f"its layer_types put full attention elsewhere than once every {interval} layers "
                          "(full_attention_interval), the only pattern a qwen3next GGUF says; drop layer_types or "
                          "set full_attention_interval to match")
    return linear


def qwen3next_specs(c: dict[str, Any]) -> list[Spec]:
    """llama.cpp's qwen3next tensors (src/models/qwen3next.cpp, load_arch_tensors), in numpy order."""
    s = _shape_of(c)
    H, NH, NKV, HD = s["H"], s["NH"], s["NKV"], s["HD"]
    kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    if kd != vd:
        raise ConfigError(f"linear_value_head_dim {vd} differs from linear_key_head_dim {kd}, but llama.cpp's "
                          "qwen3next loader sizes both from ssm.state_size; make them equal")
    if vh % kh:
        raise ConfigError(f"linear_num_value_heads {vh} is not a multiple of linear_num_key_heads {kh}, as "
                          "llama.cpp's qwen3next needs; make it one")
    key, value, kernel = kh * kd, vh * vd, c["linear_conv_kernel_dim"]
    shared = c["shared_expert_intermediate_size"]
    specs = _top(c)
    for layer, linear in enumerate(linear_layers(c)):
        p = f"blk.{layer}."
        specs += [Spec(p + "attn_norm.weight", (H,), "ones"), Spec(p + "post_attention_norm.weight", (H,), "ones")]
        if linear:   # the converter's split of in_proj_qkvz: q, k, v rows as attn_qkv, z rows as attn_gate
            specs += [Spec(p + "attn_qkv.weight", (2 * key + value, H), "matrix"),
                      Spec(p + "attn_gate.weight", (value, H), "matrix"),
                      Spec(p + "ssm_ba.weight", (2 * vh, H), "matrix"),
                      Spec(p + "ssm_conv1d.weight", (2 * key + value, kernel), "normal"),
                      Spec(p + "ssm_dt.bias", (vh,), "ones"),
                      Spec(p + "ssm_a", (vh,), "minus_one"),
                      Spec(p + "ssm_norm.weight", (vd,), "ones"),
                      Spec(p + "ssm_out.weight", (H, value), "matrix")]
        else:        # gated attention: q and its gate interleaved per head in attn_q's rows
            specs += [Spec(p + "attn_q.weight", (2 * NH * HD, H), "matrix"),
                      Spec(p + "attn_k.weight", (NKV * HD, H), "matrix"),
                      Spec(p + "attn_v.weight", (NKV * HD, H), "matrix"),
                      Spec(p + "attn_output.weight", (H, NH * HD), "matrix"),
                      Spec(p + "attn_q_norm.weight", (HD,), "ones"), Spec(p + "attn_k_norm.weight", (HD,), "ones")]
        specs += [*_experts(p, s),
                  Spec(p + "ffn_gate_inp_shexp.weight", (1, H), "normal"),   # HF's (1, H), kept 2-D by the converter
                  Spec(p + "ffn_gate_shexp.weight", (shared, H), "matrix"),
                  Spec(p + "ffn_up_shexp.weight", (shared, H), "matrix"),
                  Spec(p + "ffn_down_shexp.weight", (H, shared), "matrix")]
    return specs


# ---- the type of each tensor -------------------------------------------------------------------
BLOCK = {"Q8_0": 32, "Q4_0": 32, "MXFP4": 32, "Q6_K": 256}


def converter_type(spec: Spec) -> str:
    """The type convert_hf_to_gguf.py writes a tensor in for `--outtype bf16` (ModelBase.prepare_tensors):
    F32 for 1-D tensors, norms, whatever is not a `.weight`, and the routers, the shared expert's gate
    and ssm_conv1d (FFN_GATE_INP, FFN_GATE_INP_SHEXP, SSM_CONV1D); BF16 otherwise."""
    name = spec.name
    if len(spec.shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "F32"
    if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")):
        return "F32"
    return "BF16"


def ggml_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: the dimensions up to the last one over 1, in ggml's order (numpy's reversed)."""
    ne = list(reversed(shape))
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return len(ne)


def quantized_type(spec: Spec, qtype: str, experts: int, tied: bool) -> str:
    """The type llama-quantize gives a tensor of the BF16 conversion for file type `qtype`, its default
    mix (no imatrix, no --pure, no overrides): tensor_allows_quantization, llama_tensor_get_type_impl
    and tensor_type_fallback of src/llama-quant.cpp, for the tensors these families have."""
    name, source = spec.name, converter_type(spec)
    if qtype == "bf16":
        return source
    if (ggml_dims(spec.shape) < 2 or not name.endswith("weight") or "_norm.weight" in name
            or "ffn_gate_inp.weight" in name or "ssm_conv1d" in name):
        return source   # not quantized: kept as converted
    new = DEFAULT_TYPE[qtype]
    cols = spec.shape[-1]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if qtype == "mxfp4" or cols % BLOCK[new]:
            new = "Q8_0"
        elif new != "Q8_0":
            new = "Q6_K"
    elif qtype == "mxfp4":   # MoE tensors (a third dimension over 1) MXFP4, the rest Q8_0
        new = "MXFP4" if len(spec.shape) == 3 and spec.shape[0] > 1 else "Q8_0"
    elif name != "token_embd.weight" and experts == 8 and any(
            k in name for k in ("attn_qkv.weight", "attn_v.weight", "attn_k.weight")):
        new = "Q8_0"   # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    if cols % BLOCK[new]:   # tensor_type_fallback: Q6_K → Q8_0, a 32-block type → F16
        new = "Q8_0" if new == "Q6_K" else "F16"
        if cols % BLOCK.get(new, 1):
            new = "F16"
    return new


# ---- random data -------------------------------------------------------------------------------
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "MXFP4": 17, "Q6_K": 210}
# where each block's scale sits and the bytes that make its weights ~0.02 at most: an fp16 scale for
# Q8_0 codes up to 128 and Q4_0 codes up to 8, Q6_K's super-block scale (codes up to 32 times int8
# sub-scales up to 128), MXFP4's e8m0 byte 2^-9 (fp4 codes up to 6)
SCALE = {"Q8_0": (0, np.float16(0.02 / 128).tobytes()), "Q4_0": (0, np.float16(0.02 / 8).tobytes()),
         "Q6_K": (208, np.float16(0.02 / 4096).tobytes()), "MXFP4": (0, bytes([127 - 9]))}


def stored_layout(spec: Spec, kind: str) -> tuple[tuple[int, int], type, str | None]:
    """How `spec` is stored in ggml type `kind`: the (rows, bytes per row) or (rows, cols) array, its
    numpy dtype, and the raw_dtype to declare it with (None: the array's own dtype says)."""
    rows, cols = int(np.prod(spec.shape[:-1])), spec.shape[-1]
    if kind in BLOCK_BYTES:
        return (rows, cols // BLOCK[kind] * BLOCK_BYTES[kind]), np.uint8, kind
    if kind == "BF16":
        return (rows, cols), np.uint16, kind
    return (rows, cols), np.float16 if kind == "F16" else np.float32, None


def fill_rows(out: np.ndarray, kind: str, fill: str, seed: tuple[int, ...]) -> None:
    """Fill `out` (some rows of a tensor) with valid random weights of type `kind`, from its own
    generator (so the bytes depend on the seed, not on the thread count)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed))))
    if fill == "ones":
        out[...] = 1
    elif fill == "minus_one":
        out[...] = -1
    elif kind in ("F32", "F16"):
        out[...] = rng.standard_normal(out.shape, dtype=np.float32) * 0.02
    else:   # random bits, then the scale or exponent that keeps every weight small
        out.reshape(-1).view(np.uint8)[:] = rng.bit_generator.random_raw((out.nbytes + 7) // 8).view(np.uint8)[:out.nbytes]
        if kind == "BF16":   # random sign and mantissa, exponent 2^-7
            out &= 0x807F
            out |= 0x3C00
        else:
            at, scale = SCALE[kind]
            blocks = out.reshape(-1, BLOCK_BYTES[kind])
            blocks[:, at:at + len(scale)] = np.frombuffer(scale, np.uint8)


# --token-routing: the routers read only the residual's first `routed_dims` dimensions and every
# projection into the residual leaves them zero, so they hold the token's embedding in every layer and
# each layer picks experts by the token alone (near-uniform use over varied tokens, as llama-bench's and
# llama-batched-bench's random tokens are). All-zero bytes are zero weights in every type written here.
ROUTERS = ("ffn_gate_inp.weight",)
RESIDUAL_WRITERS = ("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def routed_dims(hidden: int) -> int:
    """The residual dimensions a token-routed model's routers read (make_random_checkpoint.py's rule)."""
    return min(64, hidden // 4)


def mask_token_routed(arr: np.ndarray, spec: Spec, routed: int) -> None:
    """Zero a router's columns past the routed dimensions, or a residual writer's first `routed` rows
    (of each expert's matrix in a stack), in the stored array."""
    name = spec.name.split(".", 2)[-1]
    if name in ROUTERS:
        arr[:, routed:] = 0
    elif name in RESIDUAL_WRITERS:
        arr.reshape(-1, spec.shape[-2], arr.shape[-1])[:, :routed] = 0


def make(spec: Spec, index: int, kind: str, seed: int, pool: ThreadPoolExecutor, routed: int = 0) -> np.ndarray:
    """The tensor's stored array, its rows filled in chunks across the pool (`routed`: the routed
    dimensions of a token-routed file, 0 for none)."""
    shape, dtype, _ = stored_layout(spec, kind)
    arr = np.empty(shape, dtype)
    step = max(1, CHUNK_BYTES // max(1, arr.shape[1] * arr.itemsize))
    jobs = [pool.submit(fill_rows, arr[a:a + step], kind, spec.fill, (seed, index, a // step))
            for a in range(0, arr.shape[0], step)]
    for job in jobs:
        job.result()
    if routed:
        mask_token_routed(arr, spec, routed)
    return arr


# ---- the file ----------------------------------------------------------------------------------
def add_metadata(w: Any, c: dict[str, Any], qtype: str) -> None:
    """The keys convert_hf_to_gguf.py writes for the family (TextModel, Qwen2MoeModel and
    Qwen3NextModel.set_gguf_parameters), and a small byte-level BPE vocabulary of the config's size."""
    s = _shape_of(c)
    w.add_block_count(s["L"])
    w.add_context_length(c.get("max_position_embeddings", 40960))
    w.add_embedding_length(s["H"])
    w.add_feed_forward_length(c.get("intermediate_size", 4 * s["H"]))
    w.add_head_count(s["NH"])
    w.add_head_count_kv(s["NKV"])
    w.add_rope_freq_base(float(c.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_expert_count(s["E"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_key_length(s["HD"])
    w.add_value_length(s["HD"])
    w.add_expert_feed_forward_length(s["I"])
    if c["model_type"] == "qwen3_next":
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        w.add_ssm_state_size(c["linear_key_head_dim"])
        w.add_ssm_group_count(c["linear_num_key_heads"])
        w.add_ssm_time_step_rank(c["linear_num_value_heads"])
        w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
        w.add_full_attention_interval(int(c.get("full_attention_interval", 4)))
        w.add_rope_dimension_count(int(s["HD"] * c.get("partial_rotary_factor", 0.25)))
    w.add_file_type(QTYPES[qtype])
    # A byte-level BPE vocabulary with one merge, as Qwen3's GGUFs hold theirs (read by both engines): every
    # byte's token (printable ASCII first where the vocabulary is smaller), so any text, digits included, spells.
    V = s["V"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(token_list(V))
    w.add_token_types([2, 3, 3] + [1] * (V - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as the printable character byte-level BPE vocabularies
    store it (printable Latin-1 as itself, the rest shifted past 255), printable ASCII and newline first."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    char, extra = {}, 0
    for b in range(256):
        char[b] = chr(b) if b in keep else chr(256 + extra)
        extra += b not in keep
    first = [ord(" "), ord("\n")] + list(range(ord("!"), ord("~") + 1))
    return [char[b] for b in first] + [char[b] for b in range(256) if b not in first]


def token_list(vocab: int) -> list[str]:
    """Three special tokens, as many byte tokens as fit, "ab" (the one merge's result), placeholders."""
    n = min(256, vocab - 4)
    tokens = ["<unk>", "<s>", "</s>"] + byte_chars()[:n] + ["ab"]
    if "a" not in tokens or "b" not in tokens:
        raise SystemExit(f"a vocabulary of {vocab} tokens is too small for the byte tokens; use at least 100.")
    return tokens + [f"<t{i}>" for i in range(len(tokens), vocab)]


def plan(c: dict[str, Any], qtype: str) -> list[tuple[Spec, str]]:
    """Every tensor of the config's GGUF with its ggml type."""
    specs = qwen3next_specs(c) if c["model_type"] == "qwen3_next" else qwen3moe_specs(c)
    tied = bool(c.get("tie_word_embeddings", False))
    return [(s, quantized_type(s, qtype, c["num_experts"], tied)) for s in specs]


def write(out: Path, c: dict[str, Any], tensors: list[tuple[Spec, str]], qtype: str, seed: int,
          threads: int, token_routing: bool = False) -> None:
    """Write the GGUF of `tensors` (plan's) at `out`: metadata and tensor infos first, then each
    tensor's data as it is generated (the next one generated while the last is written)."""
    import gguf

    partial = out.with_name(out.name + ".partial")   # a run cut short leaves no file that looks whole
    w = gguf.GGUFWriter(str(partial), ARCH[c["model_type"]])
    add_metadata(w, c, qtype)
    for spec, kind in tensors:
        (_, row), dtype, raw = stored_layout(spec, kind)
        w.add_tensor_info(spec.name, (*spec.shape[:-1], row), np.dtype(dtype),
                          int(np.prod(spec.shape[:-1])) * row * np.dtype(dtype).itemsize,
                          raw_dtype=None if raw is None else gguf.GGMLQuantizationType[raw])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    ready: queue.Queue = queue.Queue(maxsize=2)
    routed = routed_dims(c["hidden_size"]) if token_routing else 0

    def produce() -> None:
        try:
            with ThreadPoolExecutor(max(1, threads)) as pool:
                for i, (spec, kind) in enumerate(tensors):
                    ready.put(make(spec, i, kind, seed, pool, routed))
        except BaseException as exc:   # noqa: BLE001 (handed to the writer, which raises it)
            ready.put(exc)

    threading.Thread(target=produce, daemon=True).start()
    for _ in tensors:
        arr = ready.get()
        if isinstance(arr, BaseException):
            raise arr
        w.write_tensor_data(arr)
    w.close()
    os.replace(partial, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the GGUF to write")
    ap.add_argument("--config", type=Path, required=True,
                    help="config.json of the qwen3_moe or qwen3_next checkpoint to match")
    ap.add_argument("--qtype", choices=list(QTYPES), default="q4_0",
                    help="the file type: bf16 (as converted), q8_0, q4_0 or mxfp4 (MXFP4_MOE), as llama-quantize "
                         "makes them (default q4_0)")
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    ap.add_argument("--token-routing", action="store_true",
                    help="routers that pick experts by the token alone (as make_random_checkpoint.py --token-routing): "
                         "random tokens then use every expert near-uniformly, where a random model's own routers "
                         "favour a few")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads generating the random weights (default: every core)")
    a = ap.parse_args()
    try:
        import gguf
    except ImportError:
        print("random_gguf: error: the gguf package is missing; `pip install gguf` or set PYTHONPATH to llama.cpp's "
              "gguf-py folder.", file=sys.stderr)
        return 1
    try:
        c = json.loads(a.config.read_text())
    except (OSError, ValueError) as exc:
        print(f"random_gguf: error: cannot read {a.config} as a config.json ({exc}); give the checkpoint's "
              "config.json.", file=sys.stderr)
        return 1
    if c.get("model_type") not in ARCH:
        print(f"random_gguf: error: {a.config} is a {c.get('model_type')!r} checkpoint; only qwen3_moe and "
              "qwen3_next shapes have a GGUF writer here.", file=sys.stderr)
        return 1
    missing = [f for f in FIELDS[c["model_type"]] if f not in c]
    if missing:
        print(f"random_gguf: error: {a.config} lacks {', '.join(missing)}, which a {c['model_type']} GGUF is sized "
              "from; give the config.json make_random_checkpoint.py wrote.", file=sys.stderr)
        return 1
    if c["model_type"] == "qwen3_next" and not hasattr(gguf.GGUFWriter, "add_full_attention_interval"):
        print(f"random_gguf: error: the gguf package at {Path(gguf.__file__).parent} predates qwen3next; "
              "`pip install -U gguf` or set PYTHONPATH to a current llama.cpp's gguf-py folder.", file=sys.stderr)
        return 1
    try:
        tensors = plan(c, a.qtype)
    except ConfigError as exc:
        print(f"random_gguf: error: {a.config}: {exc}.", file=sys.stderr)
        return 1
    write(a.out, c, tensors, a.qtype, a.seed, a.threads, a.token_routing)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
