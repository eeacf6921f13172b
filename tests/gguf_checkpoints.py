"""Tiny GGUF checkpoints written with the `gguf` package from a tiny HF checkpoint: llama.cpp's
names (the gguf package's own name table, as llama.cpp's converter uses it), its stacked experts,
its q/k permutation for the llama family, tensors in any ggml type
(quantized with gguf's own quantizer where it has one, random valid blocks for the K-quants,
whose quantizers it lacks, with the weights those blocks stand for written back into the HF
reference), and a small BPE tokenizer in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe", "glm4_moe": "glm4moe",
        "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss", "qwen3_next": "qwen3next"}
ARCH_ENUM = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
             "mixtral": gguf.MODEL_ARCH.LLAMA, "olmoe": gguf.MODEL_ARCH.OLMOE, "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE,
             "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
             "gpt_oss": gguf.MODEL_ARCH.GPT_OSS, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT}
K_BLOCK = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k permutation: each head's rows (2, d/2) stored as (d/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def split_qkvz(data_torch: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's converter on in_proj_qkvz (conversion/qwen.py, Qwen3NextModel.modify_tensors,
    step for step): viewed as (hidden, key heads, q + k + v + z), split, each part flattened over
    the heads, q/k/v stacked → (attn_qkv, attn_gate)."""
    head_k_dim, head_v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    num_v_heads, num_k_heads = config["linear_num_value_heads"], config["linear_num_key_heads"]
    hidden_size = config["hidden_size"]
    split_arg_list_qkvz = [head_k_dim, head_k_dim, num_v_heads // num_k_heads * head_v_dim,
                           num_v_heads // num_k_heads * head_v_dim]
    data_torch = data_torch.permute(1, 0).contiguous()
    data_torch = data_torch.view(-1, num_k_heads, sum(split_arg_list_qkvz))
    q, k, v, z = torch.split(data_torch, split_arg_list_qkvz, dim=-1)
    q = q.contiguous().view(hidden_size, -1)
    k = k.contiguous().view(hidden_size, -1)
    v = v.contiguous().view(hidden_size, -1)
    z = z.contiguous().view(hidden_size, -1)
    qkv = torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous()
    return qkv, z.permute(1, 0).contiguous()


def qwen3next_tensors(name: str, w: torch.Tensor, config: dict, layout: str) -> list[tuple[str, torch.Tensor]]:
    """One HF Qwen3-Next tensor as llama.cpp's converter writes it (Qwen3NextModel.modify_tensors):
    [(the HF name the gguf name table maps, or the GGUF name itself; the tensor)]. The value
    transforms: A_log → -exp(A_log) (ssm_a), dt_bias renamed dt_proj.bias (ssm_dt.bias), conv1d
    squeezed to (channels, kernel), every norm.weight but linear_attn.norm.weight + 1; then
    in_proj_qkvz split into attn_qkv + attn_gate (`layout` "legacy": kept whole as ssm_in, as
    conversions before that split wrote it)."""
    if name.endswith(".A_log"):
        w = -torch.exp(w)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        w = w.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    if "in_proj_qkvz.weight" in name and layout != "legacy":
        bid = name.split(".")[2]
        qkv, z = split_qkvz(w, config)
        return [(f"blk.{bid}.attn_qkv.weight", qkv), (f"blk.{bid}.attn_gate.weight", z)]
    return [(name, w)]


def qwen3next_reference(name: str, w: torch.Tensor, config: dict, layout: str,
                        backs: list[torch.Tensor]) -> torch.Tensor:
    """The HF tensor `name` holding the weights its GGUF tensors (dequantized: `backs`) stand for:
    each value transform inverted, and the rows of a split put back where the converter took them
    (found by converting a tensor whose every row holds its own index)."""
    if "in_proj_qkvz.weight" in name and layout != "legacy":
        index = torch.arange(w.shape[0], dtype=torch.float32)[:, None].expand(w.shape).contiguous()
        rows = torch.cat([part[:, 0] for part in split_qkvz(index, config)]).long()
        out = torch.empty_like(w, dtype=torch.float32)
        out[rows] = torch.cat(backs)
        return out
    back = backs[0]
    if name.endswith(".A_log"):
        return torch.log(-back.double()).float()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return back - 1
    return back.reshape(w.shape)


def random_k_blocks(rows: int, k: int, qtype: str, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Valid random K-quant rows: random codes and sub-block scales, fp16 super-block scales ~`scale`."""
    size = K_BLOCK[qtype]
    b = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        d = (rng.uniform(0.5, 1.0, (rows, k // 256)) * scale).astype(np.float16)
        b[..., off:off + 2] = d.view(np.uint8).reshape(rows, k // 256, 2)
    return b.reshape(rows, -1)


def encode(w: torch.Tensor, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """(stored array, the weight it stands for) of `w` in ggml type `qtype`."""
    t = gguf.GGMLQuantizationType[qtype]
    a = w.float().numpy()
    if qtype == "F32":
        return a, w.float()
    if qtype == "F16":
        return a.astype(np.float16), torch.from_numpy(a.astype(np.float16).astype(np.float32))
    if qtype.startswith("IQ"):   # a type moestream refuses: random bytes of its block size
        per, size = gguf.GGML_QUANT_SIZES[t]
        rows = a.reshape(-1, a.shape[-1])
        stored = rng.integers(0, 256, (rows.shape[0], rows.shape[1] // per * size), dtype=np.uint8)
        return stored.reshape(*a.shape[:-1], -1), w.float()
    if qtype in K_BLOCK:
        rows = a.reshape(-1, a.shape[-1])
        scale = float(np.abs(a).max()) / (15 * 63 if qtype != "Q6_K" else 32 * 127) * 2
        blocks = random_k_blocks(rows.shape[0], rows.shape[1], qtype, rng, scale)
        stored = blocks.reshape(*a.shape[:-1], -1)
    else:
        stored = gguf.quants.quantize(a, t)
    back = gguf.quants.dequantize(stored, t)
    return stored, torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(w.shape)


def _qwen3next_layer(sd: dict, deq: dict, tensors: list, names_map, base: str, config: dict, layout: str,
                     dense: str, gate: str, rng: np.random.Generator, skip_a_log: bool = False) -> None:
    """A Qwen3-Next layer's dense tensors as llama.cpp's converter writes them, in `dense`
    (attn_gate in `gate`; norms, A_log, dt_bias, conv1d and the routers F32, as the converter keeps
    1-D tensors and llama.cpp's quantizer the conv), and their reference weights into `deq`."""
    names = sorted(n for n in sd if n.startswith(f"{base}.") and ".experts." not in n)
    fused = [n for n in names if n.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"))] if layout == "fused-qkv" else []
    for name in names:
        if name in fused:
            continue
        w = sd[name]
        backs = []
        converted = [(name, w)] if skip_a_log and name.endswith(".A_log") else qwen3next_tensors(name, w, config, layout)
        for hf, t in converted:
            gguf_name = hf if hf.startswith("blk.") else names_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf
            linear = t.dim() == 2 and "conv1d" not in hf and not hf.endswith(("mlp.gate.weight",
                                                                             "shared_expert_gate.weight"))
            qtype = (gate if gguf_name.endswith("attn_gate.weight") else dense) if linear else "F32"
            stored, back = encode(t, qtype, rng)
            tensors.append((gguf_name, stored, qtype))
            backs.append(back)
        deq[name] = qwen3next_reference(name, w, config, layout, backs)
    if fused:   # the converter's --fuse-qkv: a layer's complete q (with its gate), k, v triple concatenated as one
        # attn_qkv, rows in that order (as llama.cpp's create_tensor_qkv and qwen3next graph read it back)
        parts = [sd[n] for n in sorted(fused, key=lambda n: "qkv".index(n.split(".")[-2][0]))]
        stored, back = encode(torch.cat(parts), dense, rng)
        tensors.append((f"blk.{base.split('.')[2]}.attn_qkv.weight", stored, dense))
        for n, b in zip(sorted(fused, key=lambda n: "qkv".index(n.split(".")[-2][0])),
                        back.split([p.shape[0] for p in parts])):
            deq[n] = b


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte → printable character table (byte-level BPE's alphabet), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_tokenizer(writer: gguf.GGUFWriter, vocab: int, template: str | None) -> None:
    """A byte-level BPE vocabulary of `vocab` tokens (bytes first, then merges of them)."""
    chars = list(_bytes_to_unicode())
    tokens = chars[:vocab - 8] + [f"{chars[i]}{chars[j]}" for i, j in ((65, 66), (67, 68), (69, 70), (71, 72))]
    merges = [f"{chars[i]} {chars[j]}" for i, j in ((65, 66), (67, 68), (69, 70), (71, 72))]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 4) + [3] * 4)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 3)
    writer.add_bos_token_id(len(tokens) - 4)
    writer.add_pad_token_id(len(tokens) - 1)
    if template:
        writer.add_chat_template(template)


def make_gguf(hf_folder: Path, out: Path, reference: Path | None = None, experts: str = "F32", dense: str = "F32",
              down: str | None = None, seed: int = 0, tokenizer: bool = False, template: str | None = None,
              split: int = 1, embeddings: str = "F32", kv_b_split: bool = False, layout: str = "current",
              gate: str | None = None, skip_a_log: bool = False, fuse_gate_up: bool = False,
              omit: tuple[str, ...] = ()) -> None:
    """Write `hf_folder`'s model as a GGUF at `out` (experts in type `experts`, their down projection
    in `down` when given, attention linears in `dense`; norms, routers and embeddings in F32), and
    when `reference` is given an HF folder with the weights the GGUF stands for. `embeddings`: the
    type of the token embeddings and the output layer; `kv_b_split`: DeepSeek's kv_b_proj written as
    newer conversions do, per-head attn_k_b (transposed) and attn_v_b. Qwen3-Next: `layout` "current"
    (in_proj_qkvz as attn_qkv + attn_gate), "legacy" (as ssm_in) or "fused-qkv" (current, and each
    full-attention layer's q/k/v as one attn_qkv, the converter's --fuse-qkv); `gate`: attn_gate's
    type when not `dense`; `skip_a_log`: A_log written as it is (a wrong conversion, for refusals).
    `fuse_gate_up`: each layer's gate and up stacks as one ffn_gate_up_exps, as the converter's
    --fuse-gate-up-exps writes them (gpt-oss's gate and up biases too, as one ffn_gate_up_exps.bias);
    `omit`: GGUF tensor names left out of the file (an incomplete conversion, for refusals)."""
    config = json.loads((hf_folder / "config.json").read_text())
    model_type = config["model_type"]
    arch = ARCH[model_type]
    moe = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    sd = load_file(str(hf_folder / "model.safetensors"))
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=0 if split == 1 else split)
    L, H = config["num_hidden_layers"], config["hidden_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    E = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    writer.add_block_count(L)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(H)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(E)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if model_type in ("qwen3_moe", "qwen2_moe", "glm4_moe", "qwen3_next"):
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    else:
        writer.add_feed_forward_length(config["intermediate_size"])
    if model_type == "glm4_moe":
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_rope_dimension_count(int(config["head_dim"] * config.get("partial_rotary_factor", 0.5)))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        v3 = model_type == "deepseek_v3"
        if config.get("q_lora_rank"):
            writer.add_q_lora_rank(config["q_lora_rank"])
        writer.add_kv_lora_rank(config["kv_lora_rank"])
        writer.add_rope_dimension_count(config["qk_rope_head_dim"])
        writer.add_key_length(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
        writer.add_value_length(config["v_head_dim"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob")) and v3)
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if model_type in ("qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_next"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if model_type == "gpt_oss":   # as llama.cpp's converter: the window, the experts' width, YaRN
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        config.update(swiglu_alpha=1.702, swiglu_limit=7.0)   # llama.cpp's for every gpt-oss: the reference's too
    if model_type in ("qwen2_moe", "qwen3_next"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if model_type == "qwen3_next":   # Qwen3NextModel.set_gguf_parameters
        writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(config["linear_key_head_dim"])
        writer.add_ssm_group_count(config["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
        writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
        writer.add_full_attention_interval(config.get("full_attention_interval", 4))
        writer.add_rope_dimension_count(int(config["head_dim"] * config.get("partial_rotary_factor", 0.25)))
    if model_type == "olmoe" and config.get("clip_qkv"):
        writer.add_clamp_kqv(config["clip_qkv"])
    writer.add_vocab_size(config["vocab_size"])
    if tokenizer:
        write_tokenizer(writer, config["vocab_size"], template)
    deq = dict(sd)
    tensors = []

    def put(name: str, w: torch.Tensor, qtype: str, hf_names: list[str] | None = None) -> None:
        stored, back = encode(w, qtype, rng)
        tensors.append((name, stored, qtype))
        for i, hf in enumerate(hf_names or []):
            deq[hf] = back[i] if len(hf_names) > 1 else back

    put("token_embd.weight", sd["model.embed_tokens.weight"], embeddings, ["model.embed_tokens.weight"])
    if model_type == "qwen3_next":   # the converter's + 1 applies to the final norm too
        (_, norm), = qwen3next_tensors("model.norm.weight", sd["model.norm.weight"], config, layout)
        stored, back = encode(norm, "F32", rng)
        tensors.append(("output_norm.weight", stored, "F32"))
        deq["model.norm.weight"] = qwen3next_reference("model.norm.weight", norm, config, layout, [back])
    else:
        put("output_norm.weight", sd["model.norm.weight"], "F32")
    if "lm_head.weight" in sd and not config.get("tie_word_embeddings"):
        put("output.weight", sd["lm_head.weight"], embeddings, ["lm_head.weight"])
    names_map = gguf.get_tensor_name_map(ARCH_ENUM[model_type], L)   # llama.cpp's own name table
    for layer in range(L):
        base = f"model.layers.{layer}"
        if model_type == "qwen3_next":
            _qwen3next_layer(sd, deq, tensors, names_map, base, config, layout, dense, gate or dense, rng, skip_a_log)
        for name in ([] if model_type == "qwen3_next" else
                     sorted(n for n in sd if n.startswith(f"{base}.") and ".experts." not in n)):
            w = sd[name]
            hf = name.replace("e_score_correction_bias", "e_score_correction.bias")   # as llama.cpp's converter
            gguf_name = names_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            if gguf_name.endswith("attn_sinks"):   # a parameter in transformers, a ".weight" in llama.cpp
                gguf_name += ".weight"
            q_or_k = name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))
            if arch == "llama" and q_or_k:
                w = permute(w, heads if ".q_proj." in name else kv)
            linear = name.endswith(".weight") and w.dim() == 2 and not name.endswith((f"{moe}.gate.weight",
                                                                                         "shared_expert_gate.weight",
                                                                                         "mlp.router.weight"))
            qtype = dense if linear else "F32"
            if kv_b_split and name.endswith("kv_b_proj.weight"):   # newer llama.cpp: per-head k_b (transposed), v_b
                nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
                kv_b = w.reshape(heads, nope + v, -1)
                k_b, v_b = kv_b[:, :nope].transpose(1, 2).contiguous(), kv_b[:, nope:].contiguous()
                k_stored, k_back = encode(k_b, qtype, rng)
                v_stored, v_back = encode(v_b, qtype, rng)
                tensors += [(gguf_name.replace("attn_kv_b", "attn_k_b"), k_stored, qtype),
                            (gguf_name.replace("attn_kv_b", "attn_v_b"), v_stored, qtype)]
                deq[name] = torch.cat([k_back.transpose(1, 2), v_back], dim=1).reshape(w.shape)
                continue
            stored, back = encode(w.reshape(-1) if name.endswith("shared_expert_gate.weight") else w, qtype, rng)
            tensors.append((gguf_name, stored, qtype))
            if arch == "llama" and q_or_k:
                back = unpermute(back, heads if ".q_proj." in name else kv)
            deq[name] = back.reshape(w.shape)
        if model_type == "gpt_oss":   # stacked (E, in, out), gate and up interleaved: split as llama.cpp's converter
            stem = f"{base}.mlp.experts"
            gate_up, gate_up_bias = sd[f"{stem}.gate_up_proj"], sd[f"{stem}.gate_up_proj_bias"]
            stored = {}
            weights = {"gate": gate_up[..., 0::2].transpose(1, 2), "up": gate_up[..., 1::2].transpose(1, 2),
                       "down": sd[f"{stem}.down_proj"].transpose(1, 2)}
            biases = {"gate": gate_up_bias[..., 0::2], "up": gate_up_bias[..., 1::2],
                      "down": sd[f"{stem}.down_proj_bias"]}
            if fuse_gate_up:   # --fuse-gate-up-exps: (E, 2I, H) and (E, 2I), each expert's gate rows then its up rows
                weights["gate_up"] = torch.cat([weights.pop("gate"), weights.pop("up")], dim=1)
                biases["gate_up"] = torch.cat([biases.pop("gate"), biases.pop("up")], dim=1)
            for proj, w in weights.items():
                qtype = (down or experts) if proj == "down" else experts
                data, back = encode(w.contiguous(), qtype, rng)
                tensors.append((f"blk.{layer}.ffn_{proj}_exps.weight", data, qtype))
                stored[proj] = back.transpose(1, 2)
            if fuse_gate_up:
                stored["gate"], stored["up"] = stored.pop("gate_up").split(config["intermediate_size"], dim=-1)
            deq[f"{stem}.gate_up_proj"] = torch.stack([stored["gate"], stored["up"]], dim=-1).flatten(-2)
            deq[f"{stem}.down_proj"] = stored["down"]
            for proj, b in biases.items():
                tensors.append((f"blk.{layer}.ffn_{proj}_exps.bias", b.float().contiguous().numpy(), "F32"))
            continue
        names = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
        if f"{base}.{moe}.experts.0.{names['gate'][model_type == 'mixtral']}.weight" not in sd:
            continue   # a dense layer
        hf = {proj: [f"{base}.{moe}.experts.{e}.{mix if model_type == 'mixtral' else qwen}.weight" for e in range(E)]
              for proj, (qwen, mix) in names.items()}
        stacked = {proj: torch.stack([sd[n] for n in hf[proj]]) for proj in names}
        if fuse_gate_up:   # the converter's --fuse-gate-up-exps (ModelBase.modify_tensors): gate then up, dim 1
            stored, back = encode(torch.cat([stacked["gate"], stacked["up"]], dim=1), experts, rng)
            tensors.append((f"blk.{layer}.ffn_gate_up_exps.weight", stored, experts))
            gate_back, up_back = back.split(stacked["gate"].shape[1], dim=1)
            deq.update({n: gate_back[e] for e, n in enumerate(hf["gate"])})
            deq.update({n: up_back[e] for e, n in enumerate(hf["up"])})
        for proj in names:
            if proj != "down" and fuse_gate_up:
                continue
            put(f"blk.{layer}.ffn_{proj}_exps.weight", stacked[proj], (down or experts) if proj == "down" else experts,
                hf[proj])
    for name, stored, qtype in tensors:
        if name in omit:
            continue
        t = gguf.GGMLQuantizationType[qtype]
        if qtype in ("F32", "F16"):
            writer.add_tensor(name, stored)
        else:
            writer.add_tensor(name, stored, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if reference is not None:
        from safetensors.torch import save_file

        reference.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in deq.items()}, str(reference / "model.safetensors"))
        (reference / "config.json").write_text(json.dumps(config))
