#!/usr/bin/env python3
"""Write a random-weight Hugging Face checkpoint with the exact layout of a real MoE model.

Why: the engine is benchmarked and tested on models larger than the GPU, but this
workplace cannot download real weights.  Speed and memory behaviour depend only on
shapes, dtypes and file layout, so we write checkpoints whose ``config.json``,
tensor names, shapes and sharding match the published Hub checkpoints, filled with
seeded random values (normal(0, 0.02) like HF init, ones for norms, zeros for biases).

Usage::

    python scripts/make_random_checkpoint.py --shape qwen3-30b-a3b --layers 24 \
        --dtype bf16 --out /data/qwen3-24l [--seed 0] [--device cpu|cuda] [--shard-size 4GB] [--fp8-block 128x128 | --gptq 4]

Design notes:

* The whole tensor list is planned from the config before anything is generated,
  so every shard's safetensors header is known up front.  Each shard is then
  streamed: header first, then each tensor's bytes as soon as they are generated.
  Nothing larger than one chunk of one tensor per worker is ever held in memory.
* Random values are drawn per chunk (at most ``CHUNK_ELEMS`` elements of a tensor)
  from a generator seeded by (seed, tensor name, chunk index).  The output is
  therefore independent of the number of worker threads, of ``--shard-size`` and
  of ``--layers`` (layer 0 is identical in a 2-layer and a 48-layer checkpoint),
  but CPU and CUDA draws differ.
* Shards are written under a ``.tmp`` name and renamed when complete; the index
  (``model.safetensors.index.json``) is written last, so its presence marks a
  complete checkpoint.
* No tokenizer is written: the checkpoints are driven with token ids.
* GLM-4.5's and GLM-4.7-Flash's multi-token-prediction layer (``num_nextn_predict_layers``, stored
  after the last decoder layer) is not written: transformers neither builds nor loads it, and neither do we.
* A tensor transformers keeps in fp32 whatever the model dtype (GLM's router
  ``e_score_correction_bias``) is written as F32 in every ``--dtype``, as the Hub files hold it.
* DeepSeek-V2-Lite and GLM-4.7-Flash: multi-head latent attention's tensors (``kv_a_proj_with_mqa``,
  ``kv_b_proj``, a plain ``q_proj`` or ``q_a_proj``/``q_b_proj``); ``--tiny`` keeps a null q_lora_rank null.
* GPT-OSS (``gpt-oss-20b``): the bf16 export's layout (the Hub's MXFP4 ``*_blocks`` / ``*_scales``
  are what it dequantizes to; ``--mxfp4`` writes those instead): experts stacked per layer,
  ``mlp.experts.gate_up_proj`` (E, H, 2I) with gate and up columns interleaved, ``down_proj`` (E, I, H),
  their biases, and ``layer_types`` repeated to ``--layers``.
* Gemma 4 (``gemma-4-26b-a4b``): the text-only export's layout (``gemma4_text``, weights under
  ``model.layers``; the Hub checkpoint is the multimodal wrapper), experts stacked per layer
  (``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I)), tied embeddings (no
  ``lm_head.weight``), the last layer full attention whatever ``--layers`` says, as transformers forces.
* ``--fp8-block 128x128``: the FP8 e4m3 form DeepSeek-V3 and the Qwen3-*-FP8 checkpoints ship in:
  every linear of the decoder layers (attention, experts, shared and dense MLPs; not the routers,
  norms, embeddings or LM head) as ``F8_E4M3`` ``.weight`` plus an ``F32`` ``.weight_scale_inv`` of
  (⌈N/128⌉, ⌈K/128⌉), and ``quantization_config`` (``quant_method: fp8``, ``weight_block_size``) in
  config.json. The e4m3 values are random normal(0, 64) clamped to ±448 and every scale is
  0.02 / 64, so the weights they stand for follow the same normal(0, 0.02); only the bytes on disk
  differ (a byte a weight). Not for the stacked-expert shapes (GPT-OSS, Gemma 4).
* Qwen3-Next: its zero-centred norms (scale 1 + weight) are written as zeros, as HF initialises
  them; its multi-token-prediction weights (``mtp.*``) are not written (transformers ignores them).
* ``--gptq BITS`` (2/3/4/8, ``--gptq-group`` 128 by default, -1 per channel) writes the GPTQ form a
  GPTQModel/AutoGPTQ export has: every 2-D linear weight inside the decoder layers (attention,
  experts, shared experts, dense MLPs; routers and embeddings stay in ``--dtype``) becomes
  ``qweight`` (K·bits/32, N) I32 of random codes, ``qzeros`` (G, N·bits/32) I32 holding the
  symmetric zero point (2^(bits-1), stored minus 1 as GPTQ v1 does), ``scales`` (G, N) F16 drawn
  so that the weights spread like normal(0, 0.02), and ``g_idx`` (K,) I32 in group order;
  ``quantization_config`` names it (symmetric, no act-order). Per-expert tensors only: GPT-OSS's
  and Gemma 4's stacked experts are left in ``--dtype``.
* ``--token-routing`` (Qwen3-MoE and Qwen3-Next shapes, bf16 or FP8): a random model's routers pick
  nearly the same few experts for every token, the best case for a bank and for llama.cpp's copies of
  the experts a prompt uses. With this flag every router reads only the first 64 dimensions of the
  residual stream (its other columns zero), and every projection into the residual (attention's and
  linear attention's output, each expert's and the shared expert's down projection) has those rows zero,
  so those dimensions hold the token's embedding in every layer: each layer picks experts by the token
  alone, and a varied prompt uses them near-uniformly. The zeros cost what other values cost.
* ``--mxfp4`` (gpt-oss shapes) writes the experts as the Hub ships them: ``gate_up_proj_blocks``
  (E, 2I, H/32, 16) and ``down_proj_blocks`` (E, H, I/32, 16) U8 of random fp4 codes, their
  ``_scales`` U8 e8m0 bytes (2^-7, so the weights spread like the bf16 form's), the biases in ``--dtype``,
  and ``quantization_config`` ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.
* ``--gptq``, ``--fp8-block`` and ``--mxfp4`` exclude each other (a checkpoint has one
  ``quantization_config``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------------------
# Published configs (config.json and generation_config.json as on the Hub).
# num_hidden_layers is overridden by --layers; everything else is kept verbatim so
# that loaders read the same fields they would read for the real model.
# --------------------------------------------------------------------------------------

PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
    # allenai/OLMoE-1B-7B-0924
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "eos_token_id": 50279,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 50304,
    },
    # Qwen/Qwen1.5-MoE-A2.7B
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "model_type": "qwen2_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 5632,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # zai-org/GLM-4.5-Air
    "glm-4.5-air": {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "pad_token_id": 151329,
        "eos_token_id": [151329, 151336, 151338],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": True,
        "num_attention_heads": 96,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 46,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": 151552,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct: 3 of 4 layers Gated DeltaNet, the 4th gated attention
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # deepseek-ai/DeepSeek-V2-Lite: multi-head latent attention with a plain q_proj (q_lora_rank null),
    # yarn rope, softmax greedy routing, 2 shared experts, layer 0 dense
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 1408,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "pretraining_tp": 1,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 102400,
    },
    # zai-org/GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's layer at 30B-A3B, low-rank queries, sigmoid
    # routing with the selection bias, one shared expert, layer 0 dense
    "glm-4.7-flash": {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "pad_token_id": 154820,
        "eos_token_id": [154820, 154827, 154829],
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 10240,
        "max_position_embeddings": 202752,
        "model_type": "glm4_moe_lite",
        "moe_intermediate_size": 1536,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "num_attention_heads": 20,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.8,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 47,
        "num_key_value_heads": 20,
        "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 1.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "vocab_size": 154880,
    },
    # openai/gpt-oss-20b as its bf16 export: the published config less its quantization_config (the Hub
    # weights are MXFP4 blocks + scales; the export holds them dequantized, in transformers' layout).
    # Sinks, sliding / full layers, biases everywhere, experts stacked per layer with interleaved gate/up.
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 201088,
    },
    # Qwen3.6-35B-A3B (the same language model as Qwen3.5-35B-A3B) as its text-only export
    # (model_type qwen3_5_moe_text): the published checkpoints are vision-language ones (text_config
    # nested, weights under model.language_model), which the engine does not read. 40 layers in the
    # 3:1 pattern of Gated DeltaNet and gated full attention, 256 experts top-8 of width 512 plus a
    # gated shared expert, partial rotary (a quarter of each 256-wide head). Special token ids are
    # not written (not verified).
    "qwen3.6-35b-a3b": {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 248320,
    },
    # google/gemma-4-26B-A4B as its text-only export (model_type gemma4_text, Gemma4ForCausalLM): the
    # published checkpoint is the multimodal gemma4 wrapper, whose text_config this is. 30 layers, five
    # sliding-window (1024) layers to each full one; full layers 512 wide with 2 key/value heads whose
    # keys are the values (attention_k_eq_v), proportional rope on a quarter of each head; a dense GeGLU
    # MLP (2112) beside 128 GeGLU experts (704) at top-8 in every layer; tied embeddings, soft-capped
    # logits. No per-layer input embeddings and no shared key/value layers (both 0 here).
    "gemma-4-26b-a4b": {
        "architectures": ["Gemma4ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": True,
        "bos_token_id": 2,
        "enable_moe_block": True,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2816,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": 2112,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "max_position_embeddings": 262144,
        "model_type": "gemma4_text",
        "moe_intermediate_size": 704,
        "num_attention_heads": 16,
        "num_experts": 128,
        "num_global_key_value_heads": 2,
        "num_hidden_layers": 30,
        "num_key_value_heads": 8,
        "num_kv_shared_layers": 0,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 1024,
        "tie_word_embeddings": True,
        "top_k_experts": 8,
        "torch_dtype": "bfloat16",
        "use_bidirectional_attention": "vision",
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
    },
}

# openai/gpt-oss-120b: gpt-oss-20b's layer, 36 layers of 128 experts
PUBLISHED_CONFIGS["gpt-oss-120b"] = {**PUBLISHED_CONFIGS["gpt-oss-20b"], "num_hidden_layers": 36, "num_local_experts": 128,
                                     "layer_types": ["sliding_attention", "full_attention"] * 18}

PUBLISHED_GENERATION_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "bos_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    },
    "mixtral-8x7b": {"bos_token_id": 1, "eos_token_id": 2},
    "olmoe-1b-7b": {"eos_token_id": 50279, "pad_token_id": 1},
    "qwen1.5-moe-a2.7b": {
        "bos_token_id": 151643,
        "do_sample": False,
        "eos_token_id": 151643,
        "max_new_tokens": 2048,
    },
    "glm-4.5-air": {"eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329},
    "qwen3-next-80b-a3b": {
        "bos_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    },
    # special ids only: the sampling defaults of these two were not verified
    "deepseek-v2-lite": {"bos_token_id": 100000, "eos_token_id": 100001},
    "glm-4.7-flash": {"eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820},
    "gpt-oss-20b": {"bos_token_id": 199998, "do_sample": True, "eos_token_id": [200002, 199999, 200012],
                    "pad_token_id": 199999},
    "qwen3.6-35b-a3b": {},
    "gemma-4-26b-a4b": {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0},   # special ids only
}

PUBLISHED_GENERATION_CONFIGS["gpt-oss-120b"] = PUBLISHED_GENERATION_CONFIGS["gpt-oss-20b"]   # same tokenizer

SHAPES: tuple[str, ...] = tuple(PUBLISHED_CONFIGS)

# Sizes used by --tiny: small enough for a CPU forward pass in a unit test, while
# keeping every structural feature (GQA ratio, q/k norms, shared expert, top-k).
TINY_HIDDEN = 64
TINY_HEAD_DIM = 16
TINY_HEADS = 4
TINY_INTERMEDIATE = 96
TINY_MOE_INTERMEDIATE = 32
TINY_SHARED_INTERMEDIATE = 48
TINY_VOCAB = 256
TINY_DEFAULT_LAYERS = 2

DTYPES: dict[str, tuple[torch.dtype, str, str]] = {
    # flag: (torch dtype, safetensors dtype tag, config.json torch_dtype)
    "bf16": (torch.bfloat16, "BF16", "bfloat16"),
    "fp16": (torch.float16, "F16", "float16"),
    "fp32": (torch.float32, "F32", "float32"),
}

INIT_STD = 0.02
# Work unit for the generator threads: big tensors (embeddings, lm_head, dense
# matrices) are split into row blocks of at most this many elements so they are
# generated in parallel and never need more than one block in flight per worker.
CHUNK_ELEMS = 16 * 1024 * 1024

STORED_DTYPES = {"I32": torch.int32, "F16": torch.float16, "U8": torch.uint8}
GPTQ_BITS = (2, 3, 4, 8)
GPTQ_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight", "mlp.router.weight")

INDEX_NAME = "model.safetensors.index.json"
_OUR_FILES = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?$|^model\.safetensors\.index\.json$")


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def build_config(shape: str, layers: int | None = None, dtype: str = "bf16", tiny: bool = False) -> dict[str, Any]:
    """Return the config.json dict for ``shape``; why separate: tests check it without writing weights."""
    if shape not in PUBLISHED_CONFIGS:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    cfg = copy.deepcopy(PUBLISHED_CONFIGS[shape])
    if tiny:
        cfg = _remap_special_ids(_shrink(cfg), _tiny_special_id_map(shape))
    if layers is not None:
        if layers < 1:
            raise ValueError("--layers must be >= 1")
        cfg["num_hidden_layers"] = layers
    elif tiny:
        cfg["num_hidden_layers"] = TINY_DEFAULT_LAYERS
    if "layer_types" in cfg:   # one type per layer: the published pattern, repeated to the count
        pattern = PUBLISHED_CONFIGS[shape]["layer_types"]
        cfg["layer_types"] = [pattern[i % len(pattern)] for i in range(cfg["num_hidden_layers"])]
        if cfg["model_type"] == "gemma4_text":   # transformers forces Gemma 4's last layer full: say so
            cfg["layer_types"][-1] = "full_attention"
    cfg["torch_dtype"] = DTYPES[dtype][2]
    return cfg


def build_generation_config(shape: str, tiny: bool = False) -> dict[str, Any]:
    """Return generation_config.json for ``shape`` (special ids remapped into the tiny vocab if ``tiny``)."""
    gen = copy.deepcopy(PUBLISHED_GENERATION_CONFIGS[shape])
    if tiny:
        gen = _remap_special_ids(gen, _tiny_special_id_map(shape))
    return gen


def _shrink(cfg: dict[str, Any]) -> dict[str, Any]:
    """Shrink widths, expert count and vocab, keeping the model's structure (GQA ratio, top-k, shared expert)."""
    heads = cfg["num_attention_heads"]
    kv_ratio = heads // cfg["num_key_value_heads"]
    cfg["num_attention_heads"] = TINY_HEADS
    cfg["num_key_value_heads"] = max(1, TINY_HEADS // kv_ratio)
    cfg["hidden_size"] = TINY_HIDDEN
    if "head_dim" in cfg:
        cfg["head_dim"] = TINY_HEAD_DIM  # Qwen3: head_dim is explicit and != hidden / heads
    cfg["intermediate_size"] = TINY_INTERMEDIATE
    if "moe_intermediate_size" in cfg:
        cfg["moe_intermediate_size"] = TINY_MOE_INTERMEDIATE
    else:
        cfg["intermediate_size"] = TINY_MOE_INTERMEDIATE  # Mixtral/OLMoE: intermediate_size is the expert width
    if "shared_expert_intermediate_size" in cfg:
        cfg["shared_expert_intermediate_size"] = TINY_SHARED_INTERMEDIATE
    top_k = cfg.get("num_experts_per_tok") or cfg["top_k_experts"]
    key = next(k for k in ("num_local_experts", "n_routed_experts", "num_experts") if k in cfg)
    cfg[key] = min(cfg[key], max(8, 2 * top_k))
    cfg["vocab_size"] = TINY_VOCAB
    if "global_head_dim" in cfg:  # Gemma 4: full layers twice as wide, one key/value head; a window the tests exceed
        cfg.update(global_head_dim=2 * TINY_HEAD_DIM, num_global_key_value_heads=1, sliding_window=4,
                   vocab_size_per_layer_input=TINY_VOCAB)
    cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], 512)
    if "kv_lora_rank" in cfg:  # MLA: narrower latent, rope key and heads; a null q_lora_rank stays null
        cfg.update(kv_lora_rank=32, qk_nope_head_dim=TINY_HEAD_DIM, qk_rope_head_dim=8, v_head_dim=TINY_HEAD_DIM)
        if cfg.get("q_lora_rank") is not None:
            cfg["q_lora_rank"] = 48
    if "linear_num_key_heads" in cfg:  # Qwen3-Next's Gated DeltaNet: keep 2 value heads per key head
        ratio = cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
        cfg["linear_num_key_heads"], cfg["linear_num_value_heads"] = 2, 2 * ratio
        cfg["linear_key_head_dim"] = cfg["linear_value_head_dim"] = TINY_HEAD_DIM
    return cfg


def _tiny_special_id_map(shape: str) -> dict[int, int]:
    """Map special token ids outside the tiny vocab to its top ids (transformers warns otherwise).

    Built from both published files so config.json and generation_config.json agree.
    """
    ids: set[int] = set()
    for d in (PUBLISHED_CONFIGS[shape], PUBLISHED_GENERATION_CONFIGS[shape]):
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = d.get(k)
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    big = sorted(i for i in ids if i >= TINY_VOCAB)
    return {i: TINY_VOCAB - 1 - n for n, i in enumerate(big)}


def _remap_special_ids(d: dict[str, Any], remap: dict[int, int]) -> dict[str, Any]:
    """Apply ``remap`` to bos/eos/pad ids in ``d`` (lists kept as lists)."""
    out = dict(d)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = out.get(k)
        if isinstance(v, list):
            out[k] = [remap.get(i, i) for i in v]
        elif v is not None:
            out[k] = remap.get(v, v)
    return out


# --------------------------------------------------------------------------------------
# Tensor plan: names and shapes exactly as the Hub checkpoints store them
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its checkpoint name, shape and how to fill it."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal" | "ones" | "zeros" | "fp8" (e4m3 values) | "fp8_scale" (their block scales)
    fp32: bool = False  # F32 whatever the checkpoint dtype (transformers keeps it so)
    stored: str | None = None  # a fixed safetensors dtype ("I32", "F16"): GPTQ's parts, whatever --dtype says
    mask: str | None = None  # --token-routing: "router" (columns past the routed dims zero) or "residual" (their rows zero)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nbytes(self, itemsize: int) -> int:
        """Bytes on disk when the checkpoint's dtype has ``itemsize`` bytes."""
        if self.stored is not None:
            return self.numel * STORED_DTYPES[self.stored].itemsize
        return self.numel * (4 if self.fp32 else 1 if self.init == "fp8" else itemsize)


FP8_VALUE_STD = 64.0   # e4m3 values drawn as normal(0, 64), clamped to the format's ±448
_ROUTER = re.compile(r"(\.gate|\.router|shared_expert_gate)\.weight$")


def fp8_specs(specs: Sequence[TensorSpec], block: tuple[int, int]) -> list[TensorSpec]:
    """The FP8 block form of ``specs``: each decoder linear's weight as e4m3 bytes followed by its
    float32 ``weight_scale_inv`` grid; everything else as it was."""
    bn, bk = block
    out = []
    for s in specs:
        if (s.init == "normal" and len(s.shape) == 2 and s.name.startswith("model.layers.")
                and s.name.endswith(".weight") and not _ROUTER.search(s.name)):
            n, k = s.shape
            out += [TensorSpec(s.name, s.shape, "fp8"),
                    TensorSpec(s.name.removesuffix("weight") + "weight_scale_inv", (-(-n // bn), -(-k // bk)),
                               "fp8_scale", fp32=True)]
        else:
            out.append(s)
    return out


# --token-routing: the routers read only the first `routed_dims` dimensions of the residual stream,
# and nothing but the token embedding writes there (every projection into the residual has those rows
# zero), so each layer's choice of experts is a function of the token alone: a varied prompt uses the
# experts near-uniformly in every engine that runs the file, where a random model's own routers favour
# a few experts for every token (the best case for a bank, and for llama.cpp's copies of used experts).
TOKEN_ROUTED_TYPES = ("qwen3_moe", "qwen3_next")
_RESIDUAL_WRITER = re.compile(r"^model\.layers\.\d+\..*\.(o_proj|down_proj|out_proj)\.(weight|bias)$")
_TOKEN_ROUTER = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")


def routed_dims(hidden: int) -> int:
    """The residual dimensions a token-routed model's routers read: 64, or a quarter of a narrow model."""
    return min(64, hidden // 4)


def token_routed(cfg: dict[str, Any], specs: list[TensorSpec]) -> list[TensorSpec]:
    """`specs` with the --token-routing masks on the routers and on every projection into the residual."""
    if cfg["model_type"] not in TOKEN_ROUTED_TYPES or "quantization_config" in cfg and \
            cfg["quantization_config"]["quant_method"] != "fp8":
        raise SystemExit(f"--token-routing is written for {' and '.join(TOKEN_ROUTED_TYPES)} shapes in --dtype or "
                         "--fp8-block form")
    return [replace(s, mask="router") if _TOKEN_ROUTER.match(s.name)
            else replace(s, mask="residual") if _RESIDUAL_WRITER.match(s.name) and s.init in ("normal", "fp8")
            else s for s in specs]


def apply_mask(t: torch.Tensor, mask: str | None, start: int, dims: int) -> torch.Tensor:
    """Zero what a token-routed model keeps zero in this chunk (rows start.. of its tensor)."""
    if mask == "router":
        t[:, dims:] = 0
    elif mask == "residual":
        t[:max(0, dims - start)] = 0
    return t


def fp8_quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def parse_block(text: str) -> tuple[int, int]:
    """'128x128' → (128, 128)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX,]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"bad block {text!r}; give rows x columns, e.g. 128x128")
    return int(m.group(1)), int(m.group(2))


# Hybrid stacks of Gated DeltaNet and gated attention: Qwen3-Next, and Qwen3.5/3.6's text-only export.
HYBRID_TYPES = ("qwen3_next", "qwen3_5_moe_text")


def plan_tensors(cfg: dict[str, Any]) -> list[TensorSpec]:
    """List every tensor of the checkpoint in file order (embeddings, layers 0..N-1, final norm, lm_head)."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "normal")]
    for layer in range(cfg["num_hidden_layers"]):
        specs += _layer_specs(cfg, layer)
    specs.append(TensorSpec("model.norm.weight", (hidden,), _norm_init(cfg)))
    if not cfg.get("tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (vocab, hidden), "normal"))
    return specs


def _layer_specs(cfg: dict[str, Any], layer: int) -> list[TensorSpec]:
    """Tensors of one decoder layer: norms, attention, then the (sparse or dense) MLP."""
    if cfg["model_type"] == "gemma4_text":
        return _gemma4_layer_specs(cfg, layer)
    p = f"model.layers.{layer}."
    hidden, norm = cfg["hidden_size"], _norm_init(cfg)
    mixer = _linear_attention_specs(cfg, p + "linear_attn.") if _is_linear_layer(cfg, layer) else (
        _attention_specs(cfg, p + "self_attn."))
    specs = [
        TensorSpec(p + "input_layernorm.weight", (hidden,), norm),
        *mixer,
        TensorSpec(p + "post_attention_layernorm.weight", (hidden,), norm),
    ]
    return specs + (
        _moe_specs(cfg, p) if _is_sparse_layer(cfg, layer) else _mlp_specs(p + "mlp.", hidden, cfg["intermediate_size"])
    )


def _attention_specs(cfg: dict[str, Any], p: str) -> list[TensorSpec]:
    """q/k/v/o projections plus the per-model extras (Qwen2/GLM biases, Qwen3/GLM per-head norms, OLMoE full-width norms)."""
    if "kv_lora_rank" in cfg:
        return _mla_specs(cfg, p)
    mt, hidden = cfg["model_type"], cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    gated = 2 if mt in HYBRID_TYPES else 1  # Qwen3-Next's / Qwen3.5's q_proj also yields the output gate
    specs = [
        TensorSpec(p + "q_proj.weight", (gated * q_out, hidden), "normal"),
        TensorSpec(p + "k_proj.weight", (kv_out, hidden), "normal"),
        TensorSpec(p + "v_proj.weight", (kv_out, hidden), "normal"),
        TensorSpec(p + "o_proj.weight", (hidden, q_out), "normal"),
    ]
    if mt == "qwen2_moe" or cfg.get("attention_bias", False):
        specs += [
            TensorSpec(p + "q_proj.bias", (q_out,), "zeros"),
            TensorSpec(p + "k_proj.bias", (kv_out,), "zeros"),
            TensorSpec(p + "v_proj.bias", (kv_out,), "zeros"),
        ]
    if mt in ("qwen3_moe", *HYBRID_TYPES) or cfg.get("use_qk_norm", False):  # RMSNorm over each head
        specs += [
            TensorSpec(p + "q_norm.weight", (head_dim,), _norm_init(cfg)),
            TensorSpec(p + "k_norm.weight", (head_dim,), _norm_init(cfg)),
        ]
    elif mt == "olmoe":  # RMSNorm over the whole projection
        specs += [TensorSpec(p + "q_norm.weight", (q_out,), "ones"), TensorSpec(p + "k_norm.weight", (kv_out,), "ones")]
    if mt == "gpt_oss":  # o_proj's bias too, and one sink logit per head (HF draws them normal)
        specs += [TensorSpec(p + "o_proj.bias", (hidden,), "zeros"), TensorSpec(p + "sinks", (heads,), "normal")]
    return specs


def _gemma4_layer_specs(cfg: dict[str, Any], layer: int) -> list[TensorSpec]:
    """A Gemma 4 MoE layer as transformers v5 saves it: the layer scalar; attention (a full layer's heads
    global_head_dim wide over num_global_key_value_heads, no v_proj where keys are the values); the dense
    GeGLU MLP; the four sandwich norms and the MoE branch's three; the router (its own input scale and a
    per-expert output scale) and the experts stacked per layer, gate_up (E, 2I, H) and down (E, H, I)."""
    p, hidden, heads = f"model.layers.{layer}.", cfg["hidden_size"], cfg["num_attention_heads"]
    full = cfg["layer_types"][layer] == "full_attention"
    head_dim = cfg["global_head_dim"] if full else cfg["head_dim"]
    kv_heads = cfg["num_global_key_value_heads"] if full and cfg["attention_k_eq_v"] else cfg["num_key_value_heads"]
    n_exp, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    a = p + "self_attn."
    specs = [
        TensorSpec(p + "layer_scalar", (1,), "ones"),
        TensorSpec(a + "q_proj.weight", (heads * head_dim, hidden), "normal"),
        TensorSpec(a + "q_norm.weight", (head_dim,), "ones"),
        TensorSpec(a + "k_norm.weight", (head_dim,), "ones"),
        TensorSpec(a + "k_proj.weight", (kv_heads * head_dim, hidden), "normal"),
    ]
    if not (full and cfg["attention_k_eq_v"]):
        specs.append(TensorSpec(a + "v_proj.weight", (kv_heads * head_dim, hidden), "normal"))
    specs.append(TensorSpec(a + "o_proj.weight", (hidden, heads * head_dim), "normal"))
    specs += _mlp_specs(p + "mlp.", hidden, cfg["intermediate_size"])
    specs += [TensorSpec(p + f"{n}.weight", (hidden,), "ones") for n in
              ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    return specs + [
        TensorSpec(p + "router.scale", (hidden,), "ones"),
        TensorSpec(p + "router.per_expert_scale", (n_exp,), "ones"),
        TensorSpec(p + "router.proj.weight", (n_exp, hidden), "normal"),
        TensorSpec(p + "experts.gate_up_proj", (n_exp, 2 * inter, hidden), "normal"),
        TensorSpec(p + "experts.down_proj", (n_exp, hidden, inter), "normal"),
        *(TensorSpec(p + f"{n}.weight", (hidden,), "ones") for n in
          ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")),
    ]


def _mla_specs(cfg: dict[str, Any], p: str) -> list[TensorSpec]:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): the query plain or through its low-rank
    bottleneck, the joint kv + rope-key down-projection and its norm, the per-head up-projection, o_proj;
    attention_bias adds biases to q_a, kv_a and o only."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rank, rope, q_rank = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg.get("q_lora_rank")
    qk, v = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
    specs = [TensorSpec(p + "q_proj.weight", (heads * qk, hidden), "normal")] if q_rank is None else [
        TensorSpec(p + "q_a_proj.weight", (q_rank, hidden), "normal"),
        TensorSpec(p + "q_a_layernorm.weight", (q_rank,), "ones"),
        TensorSpec(p + "q_b_proj.weight", (heads * qk, q_rank), "normal"),
    ]
    specs += [
        TensorSpec(p + "kv_a_proj_with_mqa.weight", (rank + rope, hidden), "normal"),
        TensorSpec(p + "kv_a_layernorm.weight", (rank,), "ones"),
        TensorSpec(p + "kv_b_proj.weight", (heads * (cfg["qk_nope_head_dim"] + v), rank), "normal"),
        TensorSpec(p + "o_proj.weight", (hidden, heads * v), "normal"),
    ]
    if cfg.get("attention_bias", False):
        specs += [TensorSpec(p + "kv_a_proj_with_mqa.bias", (rank + rope,), "zeros"),
                  TensorSpec(p + "o_proj.bias", (hidden,), "zeros")]
        if q_rank is not None:
            specs.append(TensorSpec(p + "q_a_proj.bias", (q_rank,), "zeros"))
    return specs


def _norm_init(cfg: dict[str, Any]) -> str:
    """Qwen3-Next's and Qwen3.5's norms scale by (1 + weight): HF initialises them to zeros, the others to ones."""
    return "zeros" if cfg["model_type"] in HYBRID_TYPES else "ones"


def _is_linear_layer(cfg: dict[str, Any], layer: int) -> bool:
    """Mirror transformers' Qwen3-Next rule: layer_types, else every full_attention_interval-th layer
    is full attention and the rest Gated DeltaNet. Other families have no linear layers."""
    if cfg["model_type"] not in HYBRID_TYPES:
        return False
    if cfg.get("layer_types"):
        return cfg["layer_types"][layer] == "linear_attention"
    return (layer + 1) % cfg.get("full_attention_interval", 4) != 0


def _linear_attention_specs(cfg: dict[str, Any], p: str) -> list[TensorSpec]:
    """Gated DeltaNet: per-key-head qkvz and ba in-projections, depthwise conv over q/k/v, decay
    parameters (A_log zeros: A = 1; dt_bias ones as HF), the gated output norm and out_proj."""
    hidden, kernel = cfg["hidden_size"], cfg["linear_conv_kernel_dim"]
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    heads = cfg["linear_num_value_heads"]
    value = heads * cfg["linear_value_head_dim"]
    if cfg["model_type"] == "qwen3_5_moe_text":   # Qwen3.5 stores the in-projections split, in plain head order
        projections = [TensorSpec(p + "in_proj_qkv.weight", (2 * key + value, hidden), "normal"),
                       TensorSpec(p + "in_proj_z.weight", (value, hidden), "normal"),
                       TensorSpec(p + "in_proj_b.weight", (heads, hidden), "normal"),
                       TensorSpec(p + "in_proj_a.weight", (heads, hidden), "normal")]
    else:
        projections = [TensorSpec(p + "in_proj_qkvz.weight", (2 * key + 2 * value, hidden), "normal"),
                       TensorSpec(p + "in_proj_ba.weight", (2 * heads, hidden), "normal")]
    return [
        *projections,
        TensorSpec(p + "conv1d.weight", (2 * key + value, 1, kernel), "normal"),
        TensorSpec(p + "dt_bias", (heads,), "ones"),
        TensorSpec(p + "A_log", (heads,), "zeros"),
        TensorSpec(p + "norm.weight", (cfg["linear_value_head_dim"],), "ones"),
        TensorSpec(p + "out_proj.weight", (hidden, value), "normal"),
    ]


def _is_sparse_layer(cfg: dict[str, Any], layer: int) -> bool:
    """Mirror transformers' rules: Qwen MoE's mlp_only_layers / decoder_sparse_step, GLM's and DeepSeek's
    first_k_dense_replace, GLM-4.7-Flash's mlp_layer_types (default: layer 0 dense)."""
    if cfg["model_type"] == "glm4_moe_lite":
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (cfg["num_hidden_layers"] - 1)
        return types[layer] == "sparse"
    if layer < cfg.get("first_k_dense_replace", 0) or layer in cfg.get("mlp_only_layers", []):
        return False
    step = cfg.get("decoder_sparse_step", 1)
    return step > 0 and (layer + 1) % step == 0


def _moe_specs(cfg: dict[str, Any], p: str) -> list[TensorSpec]:
    """Router + per-expert matrices (+ Qwen2-MoE shared expert and its sigmoid gate, GLM's router bias and shared experts)."""
    mt, hidden = cfg["model_type"], cfg["hidden_size"]
    if mt == "mixtral":
        n_exp, inter = cfg["num_local_experts"], cfg["intermediate_size"]
        specs = [TensorSpec(p + "block_sparse_moe.gate.weight", (n_exp, hidden), "normal")]
        for e in range(n_exp):
            q = f"{p}block_sparse_moe.experts.{e}."
            specs += [
                TensorSpec(q + "w1.weight", (inter, hidden), "normal"),  # gate
                TensorSpec(q + "w2.weight", (hidden, inter), "normal"),  # down
                TensorSpec(q + "w3.weight", (inter, hidden), "normal"),  # up
            ]
        return specs
    if mt == "gpt_oss":  # a router with a bias; experts stacked (E, H, 2I) with gate/up columns interleaved
        n_exp, inter = cfg["num_local_experts"], cfg["intermediate_size"]
        q = p + "mlp.experts."
        return [
            TensorSpec(p + "mlp.router.weight", (n_exp, hidden), "normal"),
            TensorSpec(p + "mlp.router.bias", (n_exp,), "zeros"),
            TensorSpec(q + "gate_up_proj", (n_exp, hidden, 2 * inter), "normal"),
            TensorSpec(q + "gate_up_proj_bias", (n_exp, 2 * inter), "zeros"),
            TensorSpec(q + "down_proj", (n_exp, inter, hidden), "normal"),
            TensorSpec(q + "down_proj_bias", (n_exp, hidden), "zeros"),
        ]
    n_exp = cfg.get("n_routed_experts") or cfg["num_experts"]
    inter = cfg["moe_intermediate_size"] if "moe_intermediate_size" in cfg else cfg["intermediate_size"]
    specs = [TensorSpec(p + "mlp.gate.weight", (n_exp, hidden), "normal")]
    if mt in ("glm4_moe", "glm4_moe_lite", "deepseek_v3"):  # selection-only router bias, zero at init like HF's
        specs.append(TensorSpec(p + "mlp.gate.e_score_correction_bias", (n_exp,), "zeros", fp32=True))
    for e in range(n_exp):
        specs += _mlp_specs(f"{p}mlp.experts.{e}.", hidden, inter)
    if mt in ("glm4_moe", "glm4_moe_lite", "deepseek_v2", "deepseek_v3"):
        # n_shared_experts stored as one MLP of that many times the expert width
        specs += _mlp_specs(p + "mlp.shared_experts.", hidden, inter * cfg.get("n_shared_experts", 1))
    if mt in ("qwen2_moe", *HYBRID_TYPES):
        specs += _mlp_specs(p + "mlp.shared_expert.", hidden, cfg["shared_expert_intermediate_size"])
        specs.append(TensorSpec(p + "mlp.shared_expert_gate.weight", (1, hidden), "normal"))
    return specs


def gptq_specs(specs: Sequence[TensorSpec], bits: int, group: int) -> list[TensorSpec]:
    """Every 2-D linear weight inside the decoder layers (no router) as GPTQ's four parts."""
    zero_field = (1 << (bits - 1)) - 1   # the symmetric zero point 2^(bits-1), stored minus 1 (GPTQ v1)
    out = []
    for s in specs:
        n, k = s.shape if len(s.shape) == 2 else (0, 0)
        if (not s.name.startswith("model.layers.") or not s.name.endswith(".weight") or len(s.shape) != 2
                or s.name.endswith(GPTQ_ROUTERS) or k * bits % 32 or n * bits % 32
                or (group != -1 and k % group)):
            out.append(s)
            continue
        base, g = s.name.removesuffix(".weight"), (k if group == -1 else group)
        word = sum(zero_field << (bits * i) for i in range(32 // bits)) if 32 % bits == 0 else None
        out += [TensorSpec(f"{base}.qweight", (k * bits // 32, n), "codes", stored="I32"),
                TensorSpec(f"{base}.qzeros", (k // g, n * bits // 32),
                           f"fill:{word - (1 << 32) if word >= 1 << 31 else word}" if word is not None else "codes",
                           stored="I32"),
                TensorSpec(f"{base}.scales", (k // g, n), f"scale:{bits}", stored="F16"),
                TensorSpec(f"{base}.g_idx", (k,), f"g_idx:{g}", stored="I32")]
    return out


# e8m0 byte of the MXFP4 scales: uniformly random fp4 codes have an RMS of about 2.9, so 2^(120 - 127) spreads
# the weights like normal(0, INIT_STD) would.
MXFP4_SCALE_BYTE = 120
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def mxfp4_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """GPT-OSS's stacked experts as the Hub stores them: `<proj>_blocks` (E, N, K/32, 16) U8 of random
    fp4 codes (two a byte) and `<proj>_scales` (E, N, K/32) U8 e8m0 bytes, N the output rows (gate/up
    interleaved as the bf16 export's columns are); everything else, biases included, stays as it is."""
    out = []
    for s in specs:
        if not s.name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            out.append(s)
            continue
        experts, k, n = s.shape
        out += [TensorSpec(f"{s.name}_blocks", (experts, n, k // 32, 16), "bytes", stored="U8"),
                TensorSpec(f"{s.name}_scales", (experts, n, k // 32), f"fill:{MXFP4_SCALE_BYTE}", stored="U8")]
    return out


def mxfp4_config() -> dict[str, Any]:
    """`quantization_config` as the published gpt-oss config has it."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(MXFP4_NOT_CONVERTED)}


def quantized_form(cfg: dict[str, Any], specs: list[TensorSpec], gptq: int | None, gptq_group: int,
                   fp8_block: tuple[int, int] | None, mxfp4: bool) -> list[TensorSpec]:
    """The tensors (and config.json's quantization_config) of the --gptq, --fp8-block or --mxfp4 form,
    else as they are; one at most, since a checkpoint has one quantization_config."""
    asked = [flag for flag, on in (("--gptq", gptq is not None), ("--fp8-block", fp8_block is not None),
                                   ("--mxfp4", mxfp4)) if on]
    if len(asked) > 1:
        raise SystemExit(f"{' and '.join(asked)} each write the whole checkpoint's quantization; give one of them")
    if gptq is not None:
        if gptq not in GPTQ_BITS or not (gptq_group == -1 or gptq_group > 0):
            raise SystemExit(f"--gptq takes {'/'.join(map(str, GPTQ_BITS))} bits and --gptq-group -1 or a positive size")
        cfg["quantization_config"] = gptq_config(gptq, gptq_group)
        return gptq_specs(specs, gptq, gptq_group)
    if fp8_block is not None:
        if cfg["model_type"] in ("gpt_oss", "gemma4_text"):
            raise SystemExit(f"--fp8-block: {cfg['model_type']} stores its experts stacked; FP8 checkpoints store "
                             "them one by one")
        cfg["quantization_config"] = fp8_quantization_config(fp8_block)
        return fp8_specs(specs, fp8_block)
    if mxfp4:
        if cfg["model_type"] != "gpt_oss":
            raise SystemExit("--mxfp4 writes gpt-oss's experts as the Hub ships them; use a gpt-oss --shape")
        cfg["quantization_config"] = mxfp4_config()
        return mxfp4_specs(specs)
    return specs


def gptq_config(bits: int, group: int) -> dict[str, Any]:
    """`quantization_config` as GPTQModel writes it (symmetric, no act-order, v1 zero points)."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True, "desc_act": False,
            "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": "gptq"}


def _mlp_specs(p: str, hidden: int, inter: int) -> list[TensorSpec]:
    """A SwiGLU MLP in the gate_proj/up_proj/down_proj naming."""
    return [
        TensorSpec(p + "gate_proj.weight", (inter, hidden), "normal"),
        TensorSpec(p + "up_proj.weight", (inter, hidden), "normal"),
        TensorSpec(p + "down_proj.weight", (hidden, inter), "normal"),
    ]


# --------------------------------------------------------------------------------------
# Sharding and the safetensors format
# --------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Parse '4GB' (10^9) / '4GiB' (2^30) / '500MB' / plain bytes, the way HF's max_shard_size does."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(I?B?)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    num, unit, suffix = float(m.group(1)), m.group(2), m.group(3)
    base = 1024 if suffix.startswith("I") else 1000
    return int(num * base ** "_KMGT".index(unit or "_"))


def split_shards(specs: Sequence[TensorSpec], itemsize: int, shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy in-order split: a tensor starts a new shard if it would overflow the current one."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for s in specs:
        nbytes = s.nbytes(itemsize)
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    """HF shard file name (1-based)."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def safetensors_header(specs: Sequence[TensorSpec], st_dtype: str, itemsize: int) -> bytes:
    """Length-prefixed safetensors header for tensors stored back to back in ``specs`` order.

    The JSON is space-padded so the data section starts 8-byte aligned, as the
    reference writer does (lets readers mmap tensors with aligned pointers).
    """
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in specs:
        end = off + s.nbytes(itemsize)
        dtype = s.stored or ("F32" if s.fp32 else "F8_E4M3" if s.init == "fp8" else st_dtype)
        meta[s.name] = {"dtype": dtype, "shape": list(s.shape), "data_offsets": [off, end]}
        off = end
    js = json.dumps(meta, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return len(js).to_bytes(8, "little") + js


# --------------------------------------------------------------------------------------
# Random generation
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """A block of rows of one tensor: the unit of work for generator threads."""

    spec: TensorSpec
    index: int
    rows: int  # rows along dim 0 (1 for 1-D tensors treated as a single row)
    start: int = 0  # its first row


def chunks_of(spec: TensorSpec) -> Iterator[Chunk]:
    """Split ``spec`` along dim 0 into blocks of at most CHUNK_ELEMS elements (at least one row)."""
    if len(spec.shape) < 2:
        yield Chunk(spec, 0, 1)
        return
    row = spec.numel // spec.shape[0]
    per = max(1, CHUNK_ELEMS // row)
    for i, start in enumerate(range(0, spec.shape[0], per)):
        yield Chunk(spec, i, min(per, spec.shape[0] - start), start)


def chunk_seed(seed: int, name: str, index: int) -> int:
    """Stable 63-bit seed per (seed, tensor, chunk): output independent of threads, sharding and layer count."""
    h = hashlib.blake2b(f"{seed}:{name}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class ChunkGenerator:
    """Fills chunks on CPU or CUDA; one torch.Generator per thread, re-seeded per chunk."""

    def __init__(self, dtype: torch.dtype, device: str, seed: int, routed: int = 0) -> None:
        self.dtype, self.device, self.seed, self.routed = dtype, torch.device(device), seed, routed
        self._local = threading.local()

    def _gen(self) -> torch.Generator:
        g = getattr(self._local, "gen", None)
        if g is None:
            g = self._local.gen = torch.Generator(device=self.device)
        return g

    def __call__(self, c: Chunk) -> torch.Tensor:
        """Return the chunk as a contiguous CPU tensor."""
        shape = (c.rows, *c.spec.shape[1:]) if len(c.spec.shape) >= 2 else c.spec.shape
        dtype = STORED_DTYPES[c.spec.stored] if c.spec.stored else torch.float32 if c.spec.fp32 else self.dtype
        kind, _, arg = c.spec.init.partition(":")
        if kind == "fill":      # GPTQ's qzeros: one stored zero point repeated in every field
            return torch.full(shape, int(arg), dtype=torch.int64).to(dtype)
        if kind == "g_idx":     # GPTQ's group of each input column, in order
            return (torch.arange(c.spec.shape[0]) // int(arg)).to(dtype)
        if c.spec.init == "ones":
            return torch.ones(shape, dtype=dtype)
        if c.spec.init == "zeros":
            return torch.zeros(shape, dtype=dtype)
        if c.spec.init == "fp8_scale":
            return torch.full(shape, INIT_STD / FP8_VALUE_STD, dtype=torch.float32)
        g = self._gen()
        g.manual_seed(chunk_seed(self.seed, c.spec.name, c.index))
        if kind == "bytes":     # MXFP4's blocks: random bytes are two random fp4 codes
            return torch.randint(0, 256, shape, dtype=torch.uint8, device=self.device, generator=g).cpu()
        if kind == "codes":     # GPTQ's qweight: random words are random codes of any width
            t = torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int64, device=self.device, generator=g)
            return t.to(torch.int32).cpu()
        if kind == "scale":     # GPTQ's scales: (q - z)·s spread like normal(0, INIT_STD) for `arg` bits
            levels = (1 << int(arg)) / 2
            t = torch.empty(shape, dtype=torch.float32, device=self.device).uniform_(0.8, 1.2, generator=g)
            return (t * INIT_STD * 1.7 / levels).to(dtype).cpu()
        if c.spec.init == "fp8":
            t = torch.empty(shape, dtype=torch.float32, device=self.device).normal_(0.0, FP8_VALUE_STD, generator=g)
            t = apply_mask(t, c.spec.mask, c.start, self.routed).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
        else:
            t = torch.empty(shape, dtype=dtype, device=self.device).normal_(0.0, INIT_STD, generator=g)
            t = apply_mask(t, c.spec.mask, c.start, self.routed)
        return t.cpu() if t.device.type != "cpu" else t


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


class Progress:
    """Prints throughput about every ``interval`` seconds, and a summary per shard."""

    def __init__(self, total_bytes: int, interval: float = 5.0) -> None:
        self.total, self.done, self.interval = total_bytes, 0, interval
        self.t0 = self._last = time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            print(f"  {self.done / 1e9:7.2f} / {self.total / 1e9:.2f} GB  {self.rate():.2f} GB/s", flush=True)

    def rate(self) -> float:
        return self.done / 1e9 / max(time.perf_counter() - self.t0, 1e-9)


def write_shards(
    shards: Sequence[Sequence[TensorSpec]],
    out: Path,
    gen: ChunkGenerator,
    st_dtype: str,
    itemsize: int,
    workers: int,
    progress: Progress,
) -> dict[str, str]:
    """Stream every shard to disk; chunks are generated by a thread pool and written strictly in order.

    At most ``2 * workers`` chunks are in flight, bounding memory to roughly
    ``2 * workers * CHUNK_ELEMS * itemsize`` (~1 GiB with 16 workers and bf16).
    Returns the index's weight_map.
    """
    weight_map: dict[str, str] = {}
    n = len(shards)
    jobs = ((si, c) for si, specs in enumerate(shards) for s in specs for c in chunks_of(s))
    pending: deque[tuple[int, Future[torch.Tensor]]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="randgen") as pool:

        def refill() -> None:
            for si, c in jobs:
                pending.append((si, pool.submit(gen, c)))
                if len(pending) >= 2 * workers:
                    return

        refill()
        for si, specs in enumerate(shards):
            name = shard_name(si, n)
            tmp = out / (name + ".tmp")
            t0 = time.perf_counter()
            shard_bytes = sum(s.nbytes(itemsize) for s in specs)
            with open(tmp, "wb") as f:
                f.write(safetensors_header(specs, st_dtype, itemsize))
                for _ in range(sum(1 for s in specs for _ in chunks_of(s))):
                    if not pending:
                        refill()
                    sj, fut = pending.popleft()
                    assert sj == si, "chunk order mismatch"
                    t = fut.result()
                    f.write(_as_bytes(t))
                    progress.add(t.numel() * t.element_size())
                    refill()
            os.replace(tmp, out / name)
            weight_map.update({s.name: name for s in specs})
            dt = time.perf_counter() - t0
            print(
                f"wrote {name}: {shard_bytes / 1e9:.2f} GB in {dt:.1f} s ({shard_bytes / 1e9 / dt:.2f} GB/s)",
                flush=True,
            )
    return weight_map


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a contiguous CPU tensor, without a copy (numpy lacks bf16, so view as uint8)."""
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp name + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    """Create ``out``; refuse to mix with an existing checkpoint unless --overwrite (then delete only our files)."""
    out.mkdir(parents=True, exist_ok=True)
    ours = [p for p in out.iterdir() if _OUR_FILES.match(p.name)]
    if ours and not overwrite:
        raise SystemExit(f"{out} already holds a checkpoint ({ours[0].name}, ...); pass --overwrite to replace it")
    for p in ours:
        p.unlink()


def write_checkpoint(
    shape: str,
    out: Path,
    layers: int | None = None,
    dtype: str = "bf16",
    seed: int = 0,
    device: str = "cpu",
    shard_size: int = 4 * 10**9,
    tiny: bool = False,
    workers: int | None = None,
    overwrite: bool = False,
    gptq: int | None = None,
    gptq_group: int = 128,
    fp8_block: tuple[int, int] | None = None,
    mxfp4: bool = False,
    token_routing: bool = False,
) -> dict[str, Any]:
    """Write config.json, generation_config.json, the shards and the index; return a summary dict.
    `gptq` / `fp8_block` / `mxfp4`: write the GPTQ, the FP8 e4m3 block or the MXFP4 form (see the module
    docstring)."""
    torch_dtype, st_dtype, _ = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    cfg, specs = planned(shape, layers, dtype, tiny, gptq, gptq_group, fp8_block, mxfp4, token_routing)
    total = sum(s.nbytes(itemsize) for s in specs)
    shards = split_shards(specs, itemsize, shard_size)
    out = Path(out)
    _prepare_out_dir(out, overwrite)
    free = shutil.disk_usage(out).free
    if free < total + (64 << 20):
        raise SystemExit(f"not enough disk: need {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free in {out}")
    if workers is None:
        workers = 4 if device.startswith("cuda") else max(1, os.cpu_count() or 1)
    print(
        f"{shape}{' (tiny)' if tiny else ''}: {cfg['num_hidden_layers']} layers, {len(specs)} tensors, "
        f"{sum(s.numel for s in specs) / 1e9:.3f} B params, {total / 1e9:.2f} GB {dtype} in {len(shards)} shard(s) "
        f"-> {out} (device={device}, workers={workers})",
        flush=True,
    )
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", build_generation_config(shape, tiny))

    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # parallelism comes from the worker threads; avoid oversubscription
    try:
        progress = Progress(total)
        gen = ChunkGenerator(torch_dtype, device, seed, routed_dims(cfg["hidden_size"]))
        weight_map = write_shards(shards, out, gen, st_dtype, itemsize, workers, progress)
    finally:
        torch.set_num_threads(prev_threads)
    index = {
        "metadata": {"total_size": total, "random_init": f"normal(0,{INIT_STD}) seed={seed} device={device}"
                     + (" token-routed" if token_routing else "")},
        "weight_map": weight_map,
    }
    _write_json(out / INDEX_NAME, index)
    dt = time.perf_counter() - t0
    print(
        f"done: {total / 1e9:.2f} GB ({total / 2**30:.2f} GiB) in {dt:.1f} s = {total / 1e9 / dt:.2f} GB/s", flush=True
    )
    return {"out": str(out), "total_size": total, "num_shards": len(shards), "num_tensors": len(specs), "seconds": dt}


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", required=True, choices=SHAPES)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the real model's)")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where to draw random numbers: cpu or cuda[:N]")
    ap.add_argument("--shard-size", type=parse_size, default=parse_size("4GB"), help="e.g. 4GB (10^9) or 4GiB")
    ap.add_argument("--tiny", action="store_true", help="shrink widths/experts/vocab (tests; default 2 layers)")
    ap.add_argument("--workers", type=int, default=None, help="generator threads (default: all cores; 4 on cuda)")
    ap.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and size, write nothing")
    ap.add_argument("--gptq", type=int, default=None, metavar="BITS",
                    help="write the linears inside the layers in GPTQ form at 2/3/4/8 bits (symmetric, v1 zero points)")
    ap.add_argument("--gptq-group", type=int, default=128, help="GPTQ group size (-1: one group per row)")
    ap.add_argument("--fp8-block", type=parse_block, default=None, metavar="ROWSxCOLS",
                    help="write the FP8 e4m3 block form with this scale block, e.g. 128x128 (DeepSeek-V3, Qwen3-FP8)")
    ap.add_argument("--mxfp4", action="store_true",
                    help="gpt-oss shapes: write the experts in MXFP4 (blocks + e8m0 scales), as the Hub ships them")
    ap.add_argument("--token-routing", action="store_true",
                    help="routers that pick experts by the token alone, so varied tokens use every expert near-"
                         "uniformly (a random model's own routers favour a few); qwen3_moe and qwen3_next shapes")
    return ap.parse_args(argv)


def planned(shape: str, layers: int | None, dtype: str, tiny: bool, gptq: int | None = None,
            gptq_group: int = 128, fp8_block: tuple[int, int] | None = None,
            mxfp4: bool = False, token_routing: bool = False) -> tuple[dict[str, Any], list[TensorSpec]]:
    """config.json and the tensor plan, in the quantized form asked for (`quantized_form`)."""
    cfg = build_config(shape, layers, dtype, tiny)
    specs = quantized_form(cfg, plan_tensors(cfg), gptq, gptq_group, fp8_block, mxfp4)
    return cfg, token_routed(cfg, specs) if token_routing else specs


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; importable so tests run it in-process."""
    a = parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    if a.dry_run:
        cfg, specs = planned(a.shape, a.layers, a.dtype, a.tiny, a.gptq, a.gptq_group, a.fp8_block, a.mxfp4,
                             a.token_routing)
        itemsize = torch.empty((), dtype=DTYPES[a.dtype][0]).element_size()
        total = sum(s.nbytes(itemsize) for s in specs)
        n = len(split_shards(specs, itemsize, a.shard_size))
        print(json.dumps(cfg, indent=2))
        print(f"{len(specs)} tensors, {total / 1e9:.2f} GB ({total / 2**30:.2f} GiB) in {n} shard(s)")
        return 0
    write_checkpoint(a.shape, a.out, a.layers, a.dtype, a.seed, a.device, a.shard_size, a.tiny, a.workers, a.overwrite,
                     a.gptq, a.gptq_group, a.fp8_block, a.mxfp4, a.token_routing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
