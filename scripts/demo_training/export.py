"""Export through transformers' save_pretrained and the checks that the saved checkpoint is the trained model (keys, logits, tokenizer)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


import torch

from demo_training.model import DemoMoeForCausalLM
from demo_training.settings import EOS_TOKEN, ModelShape, log

def hf_config(shape: ModelShape, eos_id: int, aux_coef: float):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.moe_intermediate_size * shape.top_k,  # unused: every layer is sparse
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=0.02,
        rms_norm_eps=shape.rms_norm_eps,
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        attention_bias=False,
        use_sliding_window=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_experts_per_tok=shape.top_k,
        num_experts=shape.num_experts,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=aux_coef,
        mlp_only_layers=[],
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )


def expected_checkpoint_keys(shape: ModelShape) -> set[str]:
    """Key names of a per-expert Qwen3-MoE checkpoint (the Hugging Face hub layout)."""
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}"
        keys |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight", f"{p}.mlp.gate.weight"}
        keys |= {f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        for e in range(shape.num_experts):
            keys |= {f"{p}.mlp.experts.{e}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys


def export_model(
    state: dict[str, torch.Tensor], shape: ModelShape, eos_id: int, aux_coef: float, out_dir: Path
) -> None:
    """bf16 weights via Qwen3MoeForCausalLM.save_pretrained (which writes per-expert tensors)."""
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    config = hf_config(shape, eos_id, aux_coef)
    hf = Qwen3MoeForCausalLM(config)
    hf.load_state_dict(state, strict=True)
    hf.to(torch.bfloat16)
    hf.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
    hf.save_pretrained(out_dir)
    verify_checkpoint_keys(out_dir / "model.safetensors", shape)


def verify_checkpoint_keys(path: Path, shape: ModelShape) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    expected = expected_checkpoint_keys(shape)
    if keys != expected:
        missing, extra = sorted(expected - keys)[:5], sorted(keys - expected)[:5]
        raise RuntimeError(f"unexpected checkpoint layout: missing {missing} extra {extra}")
    if dtypes != {"BF16"}:
        raise RuntimeError(f"checkpoint dtypes {dtypes}, expected only BF16")
    log(f"checkpoint layout verified: {len(keys)} tensors, per-expert gate/up/down, bf16")


def load_saved_model(model_dir: Path, device: torch.device):
    """The saved bf16 checkpoint, upcast to fp32, through transformers' reference (eager) experts."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    return model.to(device).eval()


def saved_weights_as_training_state(hf_model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in hf_model.state_dict().items()}


@torch.no_grad()
def verify_against_training_module(hf_model, shape: ModelShape, ids: Sequence[int], device: torch.device) -> float:
    """Max |logit difference| between transformers and the training module on the same fp32 weights.

    Proves the training module's math and parameter layout are those of Qwen3MoeForCausalLM.
    """
    twin = DemoMoeForCausalLM(shape)
    twin.load_state_dict(saved_weights_as_training_state(hf_model), strict=True)
    twin.to(device).eval()
    twin.set_experts_impl("loop")
    x = torch.tensor([list(ids)], device=device)
    ours = twin(x).logits.float()
    theirs = hf_model(input_ids=x).logits.float()
    diff = float((ours - theirs).abs().max())
    scale = float(theirs.abs().max())
    if diff > 1e-3 * max(1.0, scale):
        raise RuntimeError(f"training module and transformers disagree: max |dlogit| {diff:.3e} (scale {scale:.1f})")
    log(f"transformers vs training module (fp32, {len(ids)} tokens): max |dlogit| {diff:.2e}")
    return diff


def verify_tokenizer(model_dir: Path, eos_id: int, probe: str) -> dict[str, Any]:
    """AutoTokenizer loads the saved files, adds no BOS/EOS, and round-trips text losslessly."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(probe, add_special_tokens=True).input_ids
    plain = tok(probe, add_special_tokens=False).input_ids
    if ids != plain:
        raise RuntimeError("tokenizer adds special tokens; expected a BOS-free tokenizer")
    if tok.eos_token_id != eos_id or tok.eos_token != EOS_TOKEN:
        raise RuntimeError(f"tokenizer eos {tok.eos_token!r}/{tok.eos_token_id} != {EOS_TOKEN!r}/{eos_id}")
    if tok.decode(plain) != probe:
        raise RuntimeError("tokenizer does not round-trip text")
    log(
        f"AutoTokenizer verified: {type(tok).__name__}, vocab {len(tok)}, {len(probe.encode()) / len(plain):.2f} bytes/token"
    )
    return {"class": type(tok).__name__, "vocab": len(tok), "bytes_per_token_probe": len(probe.encode()) / len(plain)}


# ---------------------------------------------------------------------------------------------
# Final evaluation: perplexity and routing statistics on heldout_sample.txt
# ---------------------------------------------------------------------------------------------
