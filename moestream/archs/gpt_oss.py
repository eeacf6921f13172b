"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): attention with a learned sink logit per head, every other
layer a sliding window of 128 positions (layer_types), biases on q/k/v/o, YaRN rotary; a router
with a bias, top-k on its logits then softmax over those k; experts with biases and a clamped
SwiGLU ((up + 1) · gate · sigmoid(alpha · gate), gate and up clamped at swiglu_limit), stored
stacked per layer (`mlp.experts.gate_up_proj` (E, H, 2I) with gate and up columns interleaved,
`down_proj` (E, I, H), and their biases). Norms scale in fp32 (transformers keeps them in fp32).

The published weights are MXFP4 (`*_blocks` + `*_scales`, quantization_config.quant_method
"mxfp4"): the experts are kept in those bytes (experts/mxfp4_store.py, mxfp4_format.py); a bf16
export (the experts dequantized) is read too."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="gpt_oss",
    model_types=("gpt_oss",),
    router="topk_softmax",
    router_name="router",
    router_bias=True,
    mixer="sink_gqa",
    layer_mixers={"sliding_attention": "sink_swa", "full_attention": "sink_gqa"},
    norm="rms_fp32_scale",
    expert_layout="stacked",
    expert_bias=True,
    expert_activation="swiglu_clamped",
    keys={
        "num_experts": ("num_local_experts", "num_experts"),
        "moe_intermediate_size": ("intermediate_size",),
        "intermediate_size": (),          # the experts' width: there are no dense layers
        "qkv_bias": ("attention_bias",),
        "o_bias": ("attention_bias",),
    },
    # transformers' GptOssConfig defaults: layer types alternate sliding / full from layer 0.
    defaults={"attention_bias": True, "qkv_bias": True, "o_bias": True, "intermediate_size": 0,
              "sliding_window": 128, "full_attention_interval": 2, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
)
