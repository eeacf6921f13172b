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
    if arch in MLA_TINY:
        return mla_config(arch, MLA_TINY[arch], **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48,
                          moe_intermediate_size=16, num_hidden_layers=3, num_experts_per_tok=2, eos_token_id=1)
    if arch == "gpt_oss":
        # layers sliding / full / sliding with a window of 6 (shorter than the test prompts); sinks; the
        # experts' SwiGLU clamped at 0.15 (so the clamp binds on these small weights) with alpha 1.3;
        # YaRN rotary as the published config has it.
        return transformers.GptOssConfig(**COMMON, intermediate_size=16, num_hidden_layers=3, head_dim=8,
                                         num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                                         swiglu_limit=0.15, swiglu_alpha=1.3, eos_token_id=1)
    if arch == "gemma4":
        # sliding (window 6, shorter than the test prompts) / full / sliding / full; the full layers
        # 16 wide with one key/value head whose keys are the values, proportional rope on a quarter
        # of each head; logits soft-capped low enough to bind; the transformers defaults otherwise.
        return transformers.Gemma4TextConfig(**COMMON, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                                             attention_k_eq_v=True, intermediate_size=24, num_hidden_layers=4,
                                             layer_types=["sliding_attention", "full_attention"] * 2,
                                             sliding_window=6, hidden_size_per_layer_input=0, enable_moe_block=True,
                                             num_experts=8, top_k_experts=2, moe_intermediate_size=16,
                                             final_logit_softcapping=3.0, eos_token_id=1)
    raise ValueError(arch)


# Multi-head latent attention families: every head expands the one latent (kv heads = heads); v_head_dim
# differs from the 12-wide q/k heads; rope key 4 wide.
MLA_SIZES = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=8)
MLA_TINY = {
    # a plain q_proj (q_lora_rank null, as V2-Lite); softmax routing limited to the 2 best of 4 groups, each
    # scored by its best expert; 2 shared experts as one wide MLP; layer 0 dense; biases on kv_a and o
    "deepseek_v2": dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5, n_shared_experts=2, first_k_dense_replace=1, attention_bias=True),
    # the low-rank query; sigmoid + correction bias in 2 groups of 4 with 1 kept; interleaved rope under
    # yarn whose mscale_all_dim sharpens the softmax (and mscale / mscale_all_dim scales cos and sin)
    "deepseek_v3": dict(q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1,
                        first_k_dense_replace=1,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 0.8}),
    # half-split rope (rope_interleave false); the middle layer dense as mlp_layer_types says
    "glm4_moe_lite": dict(q_lora_rank=24, rope_interleave=False, n_shared_experts=1,
                          mlp_layer_types=["sparse", "dense", "sparse"]),
}
# Families whose attention barely moves the residual stream at init std 0.02: unit-scale projections
# make its scale, rope layout and norms show in the logits.
UNIT_SCALE = (*MLA_TINY, "gemma4")
MLA_CONFIGS = {"deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config",
               "glm4_moe_lite": "Glm4MoeLiteConfig"}


def mla_config(arch: str, overrides: dict, **common) -> transformers.PretrainedConfig:
    """A tiny config of an MLA family: its MLA_TINY settings over `common`."""
    return getattr(transformers, MLA_CONFIGS[arch])(**{**MLA_SIZES, **common, **overrides})


def randomise_correction_bias(model: transformers.PreTrainedModel) -> None:
    """Give selection-only router biases (a buffer, zero at init) values large enough to change
    which experts win, so that using them for the choice and not for the weights is tested."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)


def follow_config_swiglu(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """GPT-OSS's clamped SwiGLU at the alpha and limit its config names. transformers up to 5.17
    hard-codes 1.702 and 7.0 in its experts (later versions read the config); the tiny config clamps
    at 0.15 so that the clamp binds, so the oracle gets the config's values set on its expert modules:
    transformers' own computation, with the parameters the checkpoint gives."""
    config = model.config
    if getattr(config, "swiglu_limit", None) is None:
        return model
    for module in model.modules():
        if hasattr(module, "alpha") and hasattr(module, "limit"):
            module.alpha, module.limit = config.swiglu_alpha, config.swiglu_limit
    return model


def make_tiny_checkpoint(arch: str, out: Path, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Random weights with non-trivial norms, biases and sharper routers, so differences show.
    `overrides`: config fields set on the tiny config first (e.g. wider heads for a GPU kernel)."""
    torch.manual_seed(seed)
    config = tiny_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("gate.weight") or name.endswith("router.weight"):  # routers, shared-expert gate
                p.normal_(0, 0.5)
            elif name.endswith("sinks"):   # GPT-OSS's attention sinks: large enough to take real mass
                p.normal_(0, 1.0)
            elif name.endswith("router.proj.weight"):   # Gemma 4's router
                p.normal_(0, 0.5)
            elif name.endswith("scale"):   # Gemma 4's router input and per-expert scales
                p.add_(torch.randn_like(p) * 0.3)
            elif arch in UNIT_SCALE and ".self_attn." in name and p.dim() == 2:
                # MLA at init std 0.02 barely moves the residual stream: unit-scale projections make
                # its scale, rope layout and latent norms show in the logits
                p.normal_(0, p.shape[1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):   # Gemma 4's stored per-layer output scale
                b.uniform_(0.5, 1.5)
    randomise_correction_bias(model)
    follow_config_swiglu(model)
    model.save_pretrained(out)
    return model


ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v2",
         "deepseek_v3", "glm4_moe_lite", "gpt_oss", "gemma4"]
# Families whose experts can be kept quantized (quantize-on-load, `moestream convert`, MLX): GPT-OSS's
# experts (biases, clamped SwiGLU) and Gemma 4's (GeGLU) are kept unquantized only so far.
QUANT_ARCHS = [arch for arch in ARCHS if arch not in ("gpt_oss", "gemma4")]


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
    if arch in MLA_TINY:   # every linear's input width (128, 64, 4 x 32) a multiple of 64
        return mla_config(arch, {**MLA_TINY[arch], **({"q_lora_rank": 64} if MLA_TINY[arch]["q_lora_rank"] else {})},
                          **{**QUANT_COMMON, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=64,
                          num_hidden_layers=3, num_experts_per_tok=2, kv_lora_rank=64, qk_nope_head_dim=32,
                          qk_rope_head_dim=32, v_head_dim=32)
    raise ValueError(arch)


def make_quant_tiny_checkpoint(out: Path, seed: int = 0, arch: str = "qwen3_moe") -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(quant_tiny_config(arch)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    randomise_correction_bias(model)
    follow_config_swiglu(model)
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
