"""Gemma 4's parts on the CPU, each against transformers' own module: the norms (pow, fp32 scale),
the router (normed residual, scale, per-expert scale after renormalising), the GeGLU experts over
bank slots, the proportional rotary, the scaled embedding, the stacked-rows expert store; prompts
longer than the window prefilled in chunks; the GPU path (the fused GeGLU kernel, whole-step CUDA
graphs when resident, never graph segments); and what the config reader does with Gemma 4's layouts
(Google's global_* keys, the last layer forced full) and refuses. The shared reference tests (tests/model/test_reference.py) run the tiny Gemma 4 too."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers.models.gemma4 import modeling_gemma4 as hf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import moestream
from moestream.archs import ARCHS, detect_arch, model_config_from_hf
from moestream.checkpoint import TensorIndex
from moestream.errors import CheckpointError, UnsupportedArchError
from moestream.experts.format import DenseFormat, ExpertShape
from moestream.experts.store import CheckpointExpertStore
from moestream.kernels.moe_reference import Activation, moe_reference
from moestream.model.gemma4_attention import proportional_inv_freq
from moestream.model.gemma4_layer import ScaledEmbedding
from moestream.model.norms import GemmaRMSNorm, UnscaledRMSNorm
from moestream.model.routers import ROUTERS
from tiny_models import tiny_config

SPEC = ARCHS["gemma4"]


def raw_config() -> dict:
    return tiny_config("gemma4").to_dict()


def ours_config(raw: dict | None = None):
    return model_config_from_hf(raw or raw_config(), SPEC)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_equal_transformers_bit_for_bit(dtype):
    x = (torch.randn(5, 3, 32) * 4).to(dtype)
    theirs = hf.Gemma4RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(32))
    ours = GemmaRMSNorm(32, 1e-6).to(dtype)
    ours.weight = torch.nn.Parameter(theirs.weight.detach().clone())
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(UnscaledRMSNorm(1e-6)(x), hf.Gemma4RMSNorm(32, eps=1e-6, with_scale=False)(x))


def test_router_equals_transformers_per_expert_scale_after_renormalising():
    config = tiny_config("gemma4")
    theirs = hf.Gemma4TextRouter(config)
    with torch.no_grad():
        theirs.proj.weight.normal_(0, 0.5)
        theirs.scale.copy_(1 + torch.randn(32) * 0.3)
        theirs.per_expert_scale.copy_(torch.rand(8) * 2)
    ours = ROUTERS[SPEC.router](ours_config())
    ours.load_state_dict(theirs.state_dict())
    h = torch.randn(11, 32) * 3
    _, want_w, want_ids = theirs(h)
    weights, ids = ours(h)
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(weights.sum(-1), torch.ones(11))   # the per-expert scale comes after the renorm
    assert torch.equal(ours.predict(h).sort(-1).values, want_ids.sort(-1).values)


def test_geglu_experts_over_slots_equal_transformers_experts():
    config = tiny_config("gemma4")
    theirs = hf.Gemma4TextExperts(config)
    with torch.no_grad():
        theirs.gate_up_proj.normal_(0, 0.3)
        theirs.down_proj.normal_(0, 0.3)
    h = torch.randn(9, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    want = theirs(h, ids, weights)
    # slots hold the experts in reverse order: slot s = expert 7 - s
    got = moe_reference(h, theirs.gate_up_proj.detach().flip(0), theirs.down_proj.detach().flip(0), 7 - ids, weights,
                        Activation("geglu_tanh"))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_proportional_rope_equals_transformers():
    config = tiny_config("gemma4")
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, None, layer_type="full_attention")
    g = ours_config().global_attention
    got = proportional_inv_freq(g.rope.theta, g.head_dim, g.rotary_fraction, g.rope.factor)
    assert torch.equal(got, want)
    assert int((got != 0).sum()) == 2   # a quarter of 16 dims rotates: 2 frequencies, the rest zero


def test_embedding_scale_is_rounded_to_the_weights_dtype_as_transformers_does():
    theirs = hf.Gemma4TextScaledWordEmbedding(10, 3072, 0, embed_scale=3072 ** 0.5).to(torch.bfloat16)
    ours = ScaledEmbedding(10, 3072).to(torch.bfloat16)
    ours.weight = torch.nn.Parameter(theirs.weight.detach().clone())
    ids = torch.tensor([[1, 2, 9]])
    assert torch.equal(ours(ids), theirs(ids))   # sqrt(3072) = 55.43 is 55.5 in bf16


def test_stacked_rows_store_reads_one_expert_as_transformers_holds_it(tiny_checkpoints):
    folder, ref = tiny_checkpoints["gemma4"]
    config = ours_config(json.loads((folder / "config.json").read_text()))
    store = CheckpointExpertStore(TensorIndex(folder), config, SPEC)
    fmt = DenseFormat("fp32", torch.float32)
    out = fmt.empty(store.shape)
    store.read_into(2, 5, fmt, out)
    experts = ref.model.layers[2].experts
    assert torch.equal(out["gate_up"], experts.gate_up_proj[5]) and torch.equal(out["down"], experts.down_proj[5])


def test_geglu_experts_run_the_fused_kernel_on_cuda(monkeypatch):
    """The fused kernels have the GeGLU epilogue: where they run (CUDA with Triton) the dispatch is the
    kernel, which reads nothing back; on the CPU it is the reference."""
    from moestream import kernels

    fmt, cuda = DenseFormat("bf16", torch.bfloat16), torch.device("cuda")
    shape = ExpertShape.of(ours_config())
    assert shape.activation.name == "geglu_tanh" and not shape.plain
    monkeypatch.setattr(kernels, "fused_moe_available", lambda: True)
    assert fmt.uses_kernels(cuda, shape) and not fmt.dispatch_syncs(cuda, shape)
    assert not fmt.uses_kernels(torch.device("cpu"), shape)


def test_gemma4_decode_never_splits_at_routers(tiny_checkpoints):
    """Gemma 4's layer is its own MoE block (fetch inside it): a fetch bank's decode is never cut into
    graph segments, which would capture its read-back; it runs eagerly instead."""
    engine = moestream.load(tiny_checkpoints["gemma4"][0], device="cpu", dtype="float32", capacity=4)
    assert not engine.model.splits_at_routers and not engine.runner.segmented


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("capacity, policy", [(None, "auto"), (4, "fetch"), (4, "hybrid")])
def test_gpu_decode_matches_transformers(tiny_checkpoints, capacity, policy):
    """On the GPU in fp32: the fused GeGLU kernel; resident or with hybrid misses, decode as whole-step
    CUDA graphs (rings, proportional rope, the layer scalar inside them); with a fetch bank, eager
    decode. Greedy tokens equal transformers' for a prompt longer than the window and a short one,
    batched."""
    folder, ref = tiny_checkpoints["gemma4"]
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 5)]
    want = [ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=16,
                         min_new_tokens=16, do_sample=False)[0, len(p):].tolist() for p in prompts]
    engine = moestream.load(folder, device="cuda", dtype="float32", capacity=capacity, prefill_chunk=5,
                            miss_policy=policy, host_tier="pinned" if capacity else "auto")
    assert not engine.bank.dispatch_syncs and engine.bank.graph_safe == (policy != "fetch")
    assert engine.generate(prompts, max_tokens=16, ignore_eos=True) == want
    engine.bank.close()


def test_long_prompt_in_chunks_shorter_than_the_window_equals_transformers(tiny_checkpoints):
    folder, ref = tiny_checkpoints["gemma4"]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    prompt = torch.randint(2, 160, (29,), generator=torch.Generator().manual_seed(7)).tolist()
    want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 29, dtype=torch.long), max_new_tokens=10,
                        min_new_tokens=10, do_sample=False)[0, 29:].tolist()
    engine.runner.prefill_chunk = 4
    assert engine.generate(prompt, max_tokens=10, ignore_eos=True) == want


def test_google_config_layout_reads_like_the_transformers_saved_one():
    """Google's config.json names the full layers' sizes global_head_dim / num_global_key_value_heads;
    transformers saves them as per_layer_config. Both read the same."""
    saved = raw_config()
    google = {k: v for k, v in saved.items() if k != "per_layer_config"}
    google.update(global_head_dim=16, num_global_key_value_heads=1)
    assert ours_config(google) == ours_config(saved)
    g = ours_config(google).global_attention
    assert (g.head_dim, g.kv_heads, g.k_eq_v, g.rope.kind, g.rotary_fraction) == (16, 1, True, "proportional", 0.25)
    # without attention_k_eq_v, num_global_key_value_heads is ignored (as transformers ignores it)
    assert ours_config({**google, "attention_k_eq_v": False}).global_attention.kv_heads == 2


def test_last_layer_is_forced_to_full_attention_as_transformers_does():
    raw = {**raw_config(), "layer_types": ["sliding_attention"] * 4}
    raw.pop("per_layer_config")
    assert ours_config(raw).layer_mixers == ("gemma_swa",) * 3 + ("gemma_gqa",)


@pytest.mark.parametrize("change, word", [
    ({"model_type": "gemma4"}, "multimodal"),
    ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"enable_moe_block": False}, "enable_moe_block"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}}, "rope type"),
])
def test_refused_variants_say_what(change, word):
    raw = {**raw_config(), **change}
    with pytest.raises((CheckpointError, UnsupportedArchError), match=word):
        model_config_from_hf(raw, detect_arch(raw))


def test_per_layer_embeddings_are_refused_when_the_key_is_absent():
    """transformers' default is 256 (per-layer embeddings on): an absent key is not zero."""
    raw = raw_config()
    raw.pop("hidden_size_per_layer_input")
    with pytest.raises(CheckpointError, match="its default"):
        model_config_from_hf(raw, SPEC)


def test_quantized_experts_are_refused(tiny_checkpoints, tmp_path):
    folder = tmp_path / "g"
    shutil.copytree(tiny_checkpoints["gemma4"][0], folder)
    with pytest.raises(Exception, match="geglu_tanh"):
        moestream.load(folder, device="cpu", dtype="float32", experts="int8")
