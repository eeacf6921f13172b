"""GGUF files (llama.cpp's format) read as a checkpoint: metadata → config.json's fields, tensor
names → ours, each tensor's bytes by offset.

A GGUF is one file (or a split set `name-00001-of-0000N.gguf`) holding key/value metadata (the
architecture's sizes under `{arch}.*`, the tokenizer under `tokenizer.*`) and tensors named
llama.cpp's way (`blk.N.attn_q.weight`, `blk.N.ffn_gate_exps.weight` stacked (E, I, H), ...),
each in a ggml type (F32/F16/BF16 or a block quantization: quant/ggml.py). Only the header is
parsed (gguf_header.py, which reads a large vocabulary far faster than `gguf.GGUFReader`); tensors
are found by offset, so opening a file reads no weight.

What llama.cpp's converter changed is undone here: the families it converts as `llama` (Mixtral)
have the rows of q and k permuted for its rotary layout (`_unpermute`); the Qwen and OLMoE
families are stored as they are, except Qwen3-Next (`qwen3next`), whose converter renames the
linear-attention tensors `ssm_*`, stores -exp(A_log) for A_log, 1 + w for its zero-centred norms,
conv1d without its middle axis, and (current conversions) in_proj_qkvz as attn_qkv + attn_gate
with the rows regrouped; gguf_index.py undoes the values and the rows.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.checkpoint.gguf_header import read_header
from moestream.errors import CheckpointError, UnsupportedArchError

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)

# general.architecture → our model type
ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral", "mixtral": "mixtral",
                 "olmoe": "olmoe", "glm4moe": "glm4_moe", "deepseek2": "deepseek_v2", "gpt-oss": "gpt_oss",
                 "qwen3next": "qwen3_next"}
PERMUTED_QK = ("llama", "mixtral")   # llama.cpp's converter permutes q/k rows of these
NORMS_PLUS_ONE = ("qwen3next",)      # ... and stores 1 + w for the zero-centred norms of these


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def split_files(path: Path) -> list[Path]:
    """The files of the checkpoint `path` names: itself, or every part of its split set (it must be
    the first), each checked to exist."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    part, count = int(m["part"]), int(m["count"])
    if part != 1:
        raise CheckpointError(f"{path.name} is part {part} of a split GGUF; give the first part, "
                              f"{m['stem']}-00001-of-{m['count']}.gguf.")
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"part {missing[0]} of the split GGUF {path.name} is missing from {path.parent}; "
                              "download every part.")
    return files


@dataclass(frozen=True)
class GGUFTensor:
    """One stored tensor: its file, the absolute byte offset of its data, its ggml type and its
    shape in row-major order (rows first: (E, N, K) for stacked experts, (N, K) for a linear)."""
    name: str
    path: Path
    offset: int
    nbytes: int
    qtype: int
    shape: tuple[int, ...]

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"


class GGUFCheckpoint:
    """Every tensor and the metadata of a GGUF checkpoint (one file or a split set)."""

    def __init__(self, path: Path):
        self.path = path
        self.files = split_files(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for i, file in enumerate(self.files):
            header = read_header(file)
            if i == 0:
                self.metadata = {key: value for key, value in header.metadata.items() if not key.startswith("GGUF.")}
            for t in header.tensors:
                if t.data_offset + t.n_bytes > header.file_size:
                    raise CheckpointError(f"{file} is truncated (tensor {t.name!r} lies past its end); re-download it.")
                if t.name in self.tensors:
                    raise CheckpointError(f"tensor {t.name!r} is in two parts of the split GGUF {path.name}; the set "
                                          "is damaged, re-download it.")
                self.tensors[t.name] = GGUFTensor(t.name, file, t.data_offset, t.n_bytes, t.ggml_type,
                                                  tuple(reversed(t.dims)))
        self.architecture = str(self.metadata.get("general.architecture") or "")
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedArchError(f"{path.name} is a GGUF of architecture {self.architecture or 'none'!r}, "
                                       f"which moestream does not read; it reads "
                                       f"{', '.join(sorted(set(ARCHITECTURES) - {'mixtral'}))} GGUFs.")
        if self.architecture == "llama" and not self.get("expert_count"):
            raise UnsupportedArchError(f"{path.name} is a dense llama GGUF (no experts); moestream runs "
                                       "Mixture-of-Experts models only.")

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.key` of the metadata."""
        value = self.metadata.get(f"{self.architecture}.{key}")
        return default if value is None else value

    @property
    def model_type(self) -> str:
        """Ours; llama.cpp's deepseek2 is DeepSeek-V2 (softmax routing) or V3 (sigmoid, gating func 2)."""
        if self.architecture == "deepseek2" and self.get("expert_gating_func", 1) == 2:
            return "deepseek_v3"
        return ARCHITECTURES[self.architecture]

    @property
    def permuted_qk(self) -> bool:
        return self.architecture in PERMUTED_QK

    @property
    def norms_plus_one(self) -> bool:
        return self.architecture in NORMS_PLUS_ONE

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path.name} has no '{self.architecture}.{key}' in its metadata; the GGUF "
                                  "is incomplete, re-convert it.")
        return value

    def hf_config(self) -> dict[str, Any]:
        """The config.json this GGUF stands for (the fields moestream reads)."""
        heads = int(self.need("attention.head_count"))
        hidden = int(self.need("embedding_length"))
        vocab = self.get("vocab_size") or len(self.metadata.get("tokenizer.ggml.tokens") or ()) or \
            self.tensors["token_embd.weight"].shape[0]
        expert_ff = self.get("expert_feed_forward_length") or self.get("feed_forward_length")
        config: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "num_hidden_layers": int(self.need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.get("attention.head_count_kv", heads)),
            "head_dim": int(self.get("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.get("context_length", 4096)),
            "rms_norm_eps": float(self.get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.get("rope.freq_base", 10000.0)),
            "num_experts_per_tok": int(self.need("expert_used_count")),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "torch_dtype": "float32",
        }
        experts = int(self.need("expert_count"))
        if self.model_type == "mixtral":
            config.update(num_local_experts=experts, intermediate_size=int(self.need("feed_forward_length")))
        elif self.model_type == "olmoe":
            config.update(num_experts=experts, intermediate_size=int(expert_ff), norm_topk_prob=False)
            clip = self.get("attention.clamp_kqv")
            if clip:
                config["clip_qkv"] = float(clip)
        elif self.model_type == "gpt_oss":
            config.update(self._gpt_oss(config, experts, int(expert_ff)))
        elif self.model_type not in ("glm4_moe", "deepseek_v2", "deepseek_v3"):
            config.update(num_experts=experts, moe_intermediate_size=int(expert_ff),
                          intermediate_size=int(self.get("feed_forward_length", expert_ff)))
        if self.model_type == "glm4_moe":   # the next-token-prediction layers at the end are not the model's
            nextn = int(self.get("nextn_predict_layers", 0))
            config.update(n_routed_experts=experts, num_hidden_layers=config["num_hidden_layers"] - nextn,
                          moe_intermediate_size=int(expert_ff),
                          intermediate_size=int(self.get("feed_forward_length", expert_ff)),
                          n_shared_experts=int(self.get("expert_shared_count", 1)),
                          first_k_dense_replace=int(self.get("leading_dense_block_count", 0)),
                          routed_scaling_factor=float(self.get("expert_weights_scale", 1.0)),
                          norm_topk_prob=bool(self.get("expert_weights_norm", True)),
                          n_group=int(self.get("expert_group_count", 1) or 1),
                          topk_group=int(self.get("expert_group_used_count", 1) or 1),
                          partial_rotary_factor=int(self.get("rope.dimension_count", config["head_dim"]))
                          / config["head_dim"],
                          use_qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
                          attention_bias="blk.0.attn_q.bias" in self.tensors)
            if self.get("expert_gating_func", 2) != 2:
                raise CheckpointError(f"{self.path.name} routes its experts with gating function "
                                      f"{self.get('expert_gating_func')} where GLM-4.5 uses sigmoid (2); the GGUF "
                                      "does not match the family moestream reads.")
        if self.architecture == "deepseek2":
            config.update(self._deepseek(config, experts, int(expert_ff)))
        if self.model_type == "qwen3_next":
            config.update(self._qwen3_next(config, int(expert_ff)))
        if self.model_type == "qwen3_moe":   # llama.cpp always renormalises qwen3moe's top-k weights
            config.update(norm_topk_prob=bool(self.get("expert_weights_norm", True)), decoder_sparse_step=1,
                          mlp_only_layers=[])
        if self.model_type == "qwen2_moe":
            shared = self.get("expert_shared_feed_forward_length")
            config.update(norm_topk_prob=bool(self.get("expert_weights_norm", False)), decoder_sparse_step=1,
                          mlp_only_layers=[], shared_expert_intermediate_size=int(shared or expert_ff),
                          qkv_bias="blk.0.attn_q.bias" in self.tensors)
        scaling = self.get("rope.scaling.type")
        if scaling and scaling != "none":
            config["rope_scaling"] = {"rope_type": scaling, "factor": float(self.get("rope.scaling.factor", 1.0)),
                                      "original_max_position_embeddings":
                                          int(self.get("rope.scaling.original_context_length",
                                                       config["max_position_embeddings"]))}
        if self.model_type == "gpt_oss" and config.get("rope_scaling", {}).get("rope_type") == "yarn":
            # gpt-oss's own YaRN (its config.json: betas 32 and 1, the correction range not rounded); llama.cpp
            # rounds that range outward, a small difference in a few frequencies: we keep the model's
            config["rope_scaling"].update(beta_fast=32.0, beta_slow=1.0, truncate=False)
        if self.architecture == "deepseek2" and config.get("rope_scaling", {}).get("rope_type") == "yarn":
            mscale = float(self.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1   # llama.cpp keeps 0.1·mscale
            config["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale, beta_fast=32, beta_slow=1)
        for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
            value = self.metadata.get(f"tokenizer.ggml.{key}")
            if value is not None:
                config[ours] = int(value)
        return config

    def _gpt_oss(self, config: dict[str, Any], experts: int, expert_ff: int) -> dict[str, Any]:
        """GPT-OSS's fields: every other layer a sliding window (llama.cpp's pattern of 2 from layer 0,
        or the per-layer flags the metadata gives), biases on the attention, the clamped SwiGLU at the
        alpha and limit llama.cpp applies to every gpt-oss (1.702, 7.0: the metadata has no key for them)."""
        layers = config["num_hidden_layers"]
        pattern = self.get("attention.sliding_window_pattern", 2)
        if isinstance(pattern, (list, tuple)):
            sliding = [bool(v) for v in pattern][:layers]
        else:
            n = int(pattern)
            sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
        return dict(num_local_experts=experts, intermediate_size=expert_ff,
                    sliding_window=int(self.need("attention.sliding_window")),
                    layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                    attention_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0)

    def _deepseek(self, config: dict[str, Any], experts: int, expert_ff: int) -> dict[str, Any]:
        """DeepSeek-V2/V3's fields: multi-head latent attention's ranks and head sizes (the MQA form
        of newer conversions keeps the per-head sizes in `*_length_mla`), routing, shared experts."""
        rope = int(self.need("rope.dimension_count"))
        key = self.get("attention.key_length_mla") or self.need("attention.key_length")
        value = self.get("attention.value_length_mla") or self.need("attention.value_length")
        groups = int(self.get("expert_group_count", 1) or 1)
        v3 = self.model_type == "deepseek_v3"
        out = dict(n_routed_experts=experts, moe_intermediate_size=expert_ff,
                   intermediate_size=int(self.get("feed_forward_length", expert_ff)),
                   num_hidden_layers=config["num_hidden_layers"] - int(self.get("nextn_predict_layers", 0)),
                   num_key_value_heads=config["num_attention_heads"], head_dim=rope,
                   q_lora_rank=int(self.get("attention.q_lora_rank", 0)) or None,
                   kv_lora_rank=int(self.need("attention.kv_lora_rank")), qk_rope_head_dim=rope,
                   qk_nope_head_dim=int(key) - rope, v_head_dim=int(value),
                   n_shared_experts=int(self.get("expert_shared_count", 1)),
                   first_k_dense_replace=int(self.get("leading_dense_block_count", 0)),
                   routed_scaling_factor=float(self.get("expert_weights_scale", 1.0)),
                   norm_topk_prob=bool(self.get("expert_weights_norm", v3)), n_group=groups,
                   topk_group=int(self.get("expert_group_used_count", 1) or 1),
                   topk_method="noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
                   scoring_func="sigmoid" if v3 else "softmax")
        return out

    def _qwen3_next(self, config: dict[str, Any], expert_ff: int) -> dict[str, Any]:
        """Qwen3-Next's fields, from the keys llama.cpp's converter writes: the Gated DeltaNet sizes
        under `ssm.*` (group_count: key heads, time_step_rank: value heads, state_size: the key head
        width, inner_size: all value heads' width, conv_kernel), which layers are linear attention
        (`attention.recurrent_layers` per layer, else every `full_attention_interval`-th layer full
        attention, 4 by default as llama.cpp reads it), the rotary share of a head
        (`rope.dimension_count`), and the shared expert's width. llama.cpp renormalises the top-k
        weights of every qwen3next, so the model does too; next-token-prediction layers at the end
        are not the model's."""
        layers = config["num_hidden_layers"] - int(self.get("nextn_predict_layers", 0))
        value_heads, inner = int(self.need("ssm.time_step_rank")), int(self.need("ssm.inner_size"))
        if inner % value_heads:
            raise CheckpointError(f"{self.path.name} has ssm.inner_size {inner}, not a multiple of its "
                                  f"{value_heads} value heads (ssm.time_step_rank); the GGUF is damaged.")
        recurrent = self.get("attention.recurrent_layers")
        if isinstance(recurrent, (list, tuple)):
            linear = [bool(v) for v in recurrent][:layers]
        elif recurrent is not None:
            linear = [bool(recurrent)] * layers
        else:
            interval = int(self.get("full_attention_interval", 4))
            linear = [(i + 1) % interval != 0 for i in range(layers)]
        return dict(num_hidden_layers=layers,
                    layer_types=["linear_attention" if v else "full_attention" for v in linear],
                    linear_num_key_heads=int(self.need("ssm.group_count")), linear_num_value_heads=value_heads,
                    linear_key_head_dim=int(self.need("ssm.state_size")), linear_value_head_dim=inner // value_heads,
                    linear_conv_kernel_dim=int(self.need("ssm.conv_kernel")),
                    partial_rotary_factor=int(self.get("rope.dimension_count", config["head_dim"]))
                    / config["head_dim"],
                    shared_expert_intermediate_size=int(self.get("expert_shared_feed_forward_length", expert_ff)),
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

    # ---- names ------------------------------------------------------------------------------
    def hf_names(self, moe_prefix: str, shared: str = "shared_expert", router: str = "gate") -> dict[str, str]:
        """Our checkpoint name → the GGUF tensor name, for every tensor the GGUF holds that we read
        as a dense parameter (experts excluded: `expert_names`); `shared`, `router`: the family's
        shared expert and router module names."""
        out = {}
        for name in self.tensors:
            hf = _hf_name(name, moe_prefix, shared, router)
            if hf is not None:
                out[hf] = name
        return out

    def expert_names(self, layer: int) -> tuple[str, str, str]:
        """The stacks holding layer `layer`'s gate, up and down projections: gate and up are one
        `ffn_gate_up_exps` (E, 2I, H) stack, each expert's gate rows then its up rows, where the
        converter fused them (--fuse-gate-up-exps)."""
        base = f"blk.{layer}"
        names = (f"{base}.ffn_gate_exps.weight", f"{base}.ffn_up_exps.weight", f"{base}.ffn_down_exps.weight")
        if names[0] not in self.tensors and f"{base}.ffn_gate_up_exps.weight" in self.tensors:
            names = (f"{base}.ffn_gate_up_exps.weight", f"{base}.ffn_gate_up_exps.weight", names[2])
        for name in names:
            if name not in self.tensors:
                if f"{base}.ffn_gate.0.weight" in self.tensors:
                    raise CheckpointError(f"{self.path.name} stores layer {layer}'s experts one tensor each (an "
                                          "old conversion); re-convert it with a current llama.cpp (stacked "
                                          "ffn_*_exps tensors).")
                raise CheckpointError(f"tensor {name!r} is missing from {self.path.name}; the GGUF is incomplete.")
        return names

    def expert_bias_names(self, layer: int) -> tuple[str, str, str]:
        """The (E, N) float stacks holding layer `layer`'s gate, up and down biases (gpt-oss): gate's
        and up's are one `ffn_gate_up_exps.bias` (E, 2I), each expert's gate biases then its up
        biases, where the converter fused them with the weights (--fuse-gate-up-exps; llama.cpp adds
        it to the fused product, then takes gate and up as its two halves)."""
        base = f"blk.{layer}"
        fused = f"{base}.ffn_gate_up_exps.bias"
        names = []
        for proj in ("gate", "up", "down"):
            name = f"{base}.ffn_{proj}_exps.bias"
            if name not in self.tensors and proj != "down" and (
                    fused in self.tensors or self.expert_names(layer)[0] == f"{base}.ffn_gate_up_exps.weight"):
                name = fused   # the fused stack: present, or the one a fused conversion lacks
            if name not in self.tensors:
                raise CheckpointError(f"tensor {name!r} is missing from {self.path.name}, whose gpt-oss experts need "
                                      "their biases; the GGUF is incomplete, re-convert it with a current llama.cpp.")
            names.append(name)
        return tuple(names)  # type: ignore[return-value]


_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "post_attention_norm": "post_attention_layernorm",   # glm4moe's name for it
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate_inp": "{moe}.{router}", "ffn_gate_shexp": "{moe}.{shared}.gate_proj",
          "ffn_up_shexp": "{moe}.{shared}.up_proj", "ffn_down_shexp": "{moe}.{shared}.down_proj",
          "ffn_gate_inp_shexp": "{moe}.shared_expert_gate", "exp_probs_b": "{moe}.gate",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
          "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
          "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
          "attn_sinks": "self_attn.sinks",
          # Qwen3-Next's Gated DeltaNet (attn_qkv + attn_gate of current conversions: gguf_index.py)
          "ssm_in": "linear_attn.in_proj_qkvz", "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d",
          "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
# llama.cpp's names of parameters that are not a module's weight or bias: (name, part) → ours
_PARAMETERS = {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(name: str, moe_prefix: str, shared: str = "shared_expert", router: str = "gate") -> str | None:
    module, _, part = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{part}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?", name)
    if m is not None and (m[2], m[3]) in _PARAMETERS:
        return f"model.layers.{m[1]}.{_PARAMETERS[m[2], m[3]]}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if m is None or m[2] not in _LAYER:
        return None
    if m[2] == "exp_probs_b":   # the router's selection-only correction bias
        part = "e_score_correction_bias"
    ours = f"model.layers.{m[1]}.{_LAYER[m[2]].format(moe=moe_prefix, shared=shared, router=router)}"
    return ours if m[2] == "attn_sinks" else f"{ours}.{part}"   # gpt-oss's sinks: a parameter, not a module


@functools.lru_cache(maxsize=4)
def _cached(path: str, stamp: tuple) -> GGUFCheckpoint:
    return GGUFCheckpoint(Path(path))


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The checkpoint at `path`, parsed once per file version (plans and builds share it)."""
    path = Path(path).expanduser().resolve()
    try:
        stamp = tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in split_files(path))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} ({exc.strerror}); check the path.") from None
    return _cached(str(path), stamp)


def gguf_metadata(path: Path, key: str) -> Any:
    """One metadata value of the GGUF at `path` (torch-free: the CLI asks before anything loads)."""
    return open_gguf(path).metadata.get(key)
