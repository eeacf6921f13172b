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
    raise ValueError(arch)


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
    model.save_pretrained(out)
    return model


ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def quant_tiny_config() -> transformers.PretrainedConfig:
    """A tiny qwen3_moe whose widths (hidden 128, expert 64) every group size of 32 and 64 divides."""
    return transformers.Qwen3MoeConfig(vocab_size=160, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=32, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=3,
                                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                       max_position_embeddings=256, eos_token_id=1)


def make_quant_tiny_checkpoint(out: Path, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(quant_tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    return model
