"""Tiny random checkpoints of every supported family, saved in HF layout by transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=160, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                                           head_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                           mlp_only_layers=[1], eos_token_id=1)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=24, num_hidden_layers=3, num_experts=8,
                                           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[2],
                                           eos_token_id=1)
    if arch == "mixtral":
        return transformers.MixtralConfig(**COMMON, intermediate_size=16, num_hidden_layers=2, num_local_experts=8,
                                          num_experts_per_tok=2, eos_token_id=1)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**COMMON, intermediate_size=16, num_hidden_layers=2, num_experts=8,
                                        num_experts_per_tok=2, clip_qkv=4.0, eos_token_id=1, pad_token_id=0)
    if arch == "glm4_moe":
        # 2 groups of 4 experts with 1 kept: group-limited routing decides; layer 0 dense; partial
        # rotary on 8 of 16 dims per head; q/k norm; q/k/v biases; routed scaling.
        return transformers.Glm4MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                                          head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                          topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                          routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                                          eos_token_id=1)
    if arch == "qwen3_next":
        # layers 0-2 Gated DeltaNet (layer 1 dense), layer 3 gated attention with rotary on 4 of 16
        # dims; 2 key heads serving 4 value heads in the linear layers.
        return transformers.Qwen3NextConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24, num_hidden_layers=4, head_dim=16,
                                            num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                                            linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                            linear_key_head_dim=8, linear_value_head_dim=8, eos_token_id=1)
    if arch == "qwen3_5_moe":   # the text-only export: the same hybrid, split linear in-projections
        return transformers.Qwen3_5MoeTextConfig(**COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                 num_hidden_layers=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                 linear_conv_kernel_dim=4, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=8,
                                                 linear_value_head_dim=8, eos_token_id=1)
    raise ValueError(arch)


def randomise_correction_bias(model: transformers.PreTrainedModel) -> None:
    """Give selection-only router biases (a buffer, zero at init) values large enough to change
    which experts win, so that using them for the choice and not for the weights is tested."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)


def make_tiny_checkpoint(arch: str, out: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """Random weights with non-trivial norms, biases and sharper routers, so differences show."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("gate.weight"):  # routers and the shared-expert gate
                p.normal_(0, 0.5)
    randomise_correction_bias(model)
    model.save_pretrained(out)
    return model


ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "qwen3_next", "qwen3_5_moe"]


QUANT_COMMON = dict(vocab_size=160, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, eos_token_id=1)


def quant_tiny_config(arch: str = "qwen3_moe") -> transformers.PretrainedConfig:
    """Tiny configs whose widths (hidden 128, expert 64) every group size of 32 and 64 divides."""
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**QUANT_COMMON, head_dim=32, intermediate_size=64, moe_intermediate_size=64,
                                           num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True, mlp_only_layers=[1])
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**QUANT_COMMON, intermediate_size=64, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64, num_hidden_layers=2, num_experts=8,
                                           num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(**QUANT_COMMON, intermediate_size=64, num_hidden_layers=2,
                                          num_local_experts=8, num_experts_per_tok=2)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**QUANT_COMMON, intermediate_size=64, num_hidden_layers=2, num_experts=8,
                                        num_experts_per_tok=2, pad_token_id=0)
    if arch == "glm4_moe":
        return transformers.Glm4MoeConfig(**QUANT_COMMON, head_dim=32, intermediate_size=64, moe_intermediate_size=64,
                                          num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                          topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                          use_qk_norm=True, attention_bias=True)
    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(**QUANT_COMMON, head_dim=32, intermediate_size=64, moe_intermediate_size=64,
                                            shared_expert_intermediate_size=64, num_hidden_layers=4, num_experts=8,
                                            num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                                            linear_key_head_dim=32, linear_value_head_dim=32)
    if arch == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**QUANT_COMMON, head_dim=32, moe_intermediate_size=64,
                                                 shared_expert_intermediate_size=64, num_hidden_layers=4,
                                                 num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=32,
                                                 linear_value_head_dim=32)
    raise ValueError(arch)


def make_quant_tiny_checkpoint(out: Path, seed: int = 0, arch: str = "qwen3_moe") -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(quant_tiny_config(arch)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    randomise_correction_bias(model)
    model.save_pretrained(out)
    return model


def make_mlx_checkpoint(hf_folder: Path, out: Path, reference: Path, moe_prefix: str, bits: int = 4,
                        group: int = 32) -> None:
    """Write the mlx-community layout of the HF checkpoint in `hf_folder` to `out`: every linear and
    embedding affine-quantized (routers at 8 bits through per-module overrides), experts stacked per
    layer under `switch_mlp` as uint32 words, `quantization` in config.json; and, to `reference`, the
    same model in HF layout holding the dequantized weights (what transformers runs as the oracle).
    Packing follows moestream.quant's layout, which is MLX's."""
    import json

    from safetensors.torch import load_file, save_file

    from moestream.quant import QuantSpec, dequantize, quantize

    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    source = load_file(str(hf_folder / "model.safetensors"))
    mlx, deq, overrides, experts = {}, {}, {}, {}
    for name, w in source.items():
        path, _, part = name.rpartition(".")
        if part != "weight" or w.dim() != 2 or "norm" in path:
            mlx[name] = deq[name] = w
            continue
        router = path.endswith(f"{moe_prefix}.gate") or path.endswith("shared_expert_gate")
        spec = QuantSpec("int", 8 if router else bits, group, torch.float32)
        qt = quantize(w.float(), spec)
        deq[name] = dequantize(qt.qweight, qt.scales, qt.biases, spec)
        if router:
            overrides[path] = {"group_size": group, "bits": 8}
        if ".experts." in path:
            layer, expert = int(path.split(".")[2]), int(path.split(".experts.")[1].split(".")[0])
            proj = names.get(path.rsplit(".", 1)[1], path.rsplit(".", 1)[1])
            experts.setdefault((layer, proj), {})[expert] = qt
            continue
        mlx[f"{path}.weight"], mlx[f"{path}.scales"], mlx[f"{path}.biases"] = (
            qt.qweight.view(torch.uint32), qt.scales, qt.biases)
    for (layer, proj), by_expert in experts.items():
        base = f"model.layers.{layer}.{moe_prefix}.switch_mlp.{proj}"
        ordered = [by_expert[e] for e in sorted(by_expert)]
        mlx[f"{base}.weight"] = torch.stack([qt.qweight.view(torch.uint32) for qt in ordered])
        mlx[f"{base}.scales"] = torch.stack([qt.scales for qt in ordered])
        mlx[f"{base}.biases"] = torch.stack([qt.biases for qt in ordered])
    config = json.loads((hf_folder / "config.json").read_text())
    for folder, tensors, extra in ((out, mlx, {"quantization": {"group_size": group, "bits": bits, **overrides}}),
                                   (reference, deq, {})):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
