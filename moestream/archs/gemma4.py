"""Gemma 4 MoE, text model (model_type gemma4_text: Gemma4ForCausalLM; e.g. a text-only export of
gemma-4-26B-A4B). Sliding-window layers (a ring cache of the window) and full ("global") layers with
wider heads, their own key/value heads (keys reused as values where attention_k_eq_v) and a
proportional rotary on a fraction of each head; q/k norms, a weightless v norm, softmax scale 1.
Every layer has a dense GeGLU MLP beside the routed experts, sandwich norms around attention and
both feed-forward parts, and a stored per-layer output scalar (model/gemma4_layer.py). The router
normalises the residual stream itself, scales it, and multiplies the renormalised top-k weights by a
learnt per-expert scale. Experts: GeGLU (tanh gelu), stacked as transformers v5 stores them
(`experts.gate_up_proj` (E, 2I, H), `experts.down_proj` (E, H, I)). Embeddings scaled by
sqrt(hidden); final logits soft-capped. Gemma's norms scale by the weight itself (not 1 + weight).

Not read: the multimodal wrapper (model_type gemma4: text_config nested, weights under
model.language_model), per-layer input embeddings (hidden_size_per_layer_input, the E2B/E4B
models), shared key/value layers (num_kv_shared_layers), bidirectional attention, dense-only
Gemma 4 (enable_moe_block false): each is refused when config.json is read."""

from moestream.archs.spec import ArchSpec

SPEC = ArchSpec(
    name="gemma4",
    model_types=("gemma4_text",),
    router="scaled_softmax_topk",
    router_name="router",
    moe_prefix="",
    mixer="gemma_gqa",
    layer_mixers={"sliding_attention": "gemma_swa", "full_attention": "gemma_gqa"},
    global_layers=True,
    norm="gemma_rms",
    layer="gemma4",
    embed_scale=True,
    expert_layout="stacked_rows",
    expert_activation="geglu_tanh",
    variants={"hidden_activation": ("gelu_pytorch_tanh",), "enable_moe_block": (True,),
              "hidden_size_per_layer_input": (0,), "num_kv_shared_layers": (0,),
              "use_bidirectional_attention": ("vision",)},
    keys={"num_experts_per_tok": ("top_k_experts",), "norm_topk_prob": (),
          "qkv_bias": ("attention_bias",), "o_bias": ("attention_bias",)},
    # transformers' Gemma4TextConfig defaults (a sliding layer 5 of every 6, the last one full).
    defaults={"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "attention_bias": False, "sliding_window": 512, "full_attention_interval": 6,
              "norm_topk_prob": True, "hidden_activation": "gelu_pytorch_tanh", "enable_moe_block": False,
              "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0, "attention_k_eq_v": False,
              "rope_sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "rope_full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1000000.0}},
)
