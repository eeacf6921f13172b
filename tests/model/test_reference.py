"""The correctness oracle: our fp32 CPU logits and greedy tokens against transformers, per family."""

import pytest
import torch

import moestream
from tiny_models import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_on_a_padded_batch(arch, tiny_checkpoints):
    folder, ref_model = tiny_checkpoints[arch]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 160, (2, 17), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # second sequence is shorter (right padding)
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask).logits
    out = engine.logits(ids, mask)
    real = mask.bool()
    rel = (out - ref)[real].abs().max() / ref[real].abs().max()
    assert rel <= 1e-4, f"{arch}: max |diff| / max |ref| = {rel:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(arch, tiny_checkpoints):
    folder, ref_model = tiny_checkpoints[arch]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 160, (n,), generator=gen).tolist() for n in (5, 13)]
    expected = []
    for p in prompts:
        out = ref_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=32, min_new_tokens=32, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    # one at a time, and both together in one batch of different lengths
    assert engine.generate(prompts[0], max_tokens=32, ignore_eos=True) == expected[0]
    assert engine.generate(prompts, max_tokens=32, ignore_eos=True) == expected
    # and through a bank holding 3 of the 8 experts per layer: fetched misses keep it exact
    bounded = moestream.load(folder, device="cpu", dtype="float32", capacity=3)
    assert bounded.generate(prompts, max_tokens=32, ignore_eos=True) == expected
    assert bounded.stats()["misses"] > 0


GLM_VARIANTS = {
    # GLM-4.5-Air's switches: no q/k norm, one expert group, all layers MoE, weights not renormalised
    "air": dict(use_qk_norm=False, n_group=1, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False),
    # an older config.json layout: rope_theta and partial_rotary_factor at the top level
    "legacy_rope": dict(n_group=4, topk_group=2, num_experts_per_tok=3, partial_rotary_factor=0.25),
}


@pytest.mark.parametrize("variant", GLM_VARIANTS)
def test_glm4_moe_variants_match_transformers(variant, tmp_path):
    import json

    import transformers

    from tiny_models import COMMON, randomise_correction_bias

    overrides = dict(GLM_VARIANTS[variant])
    partial = overrides.pop("partial_rotary_factor", None)
    config = transformers.Glm4MoeConfig(**{**COMMON, "intermediate_size": 48, "moe_intermediate_size": 16,
                                           "num_hidden_layers": 2, "head_dim": 16, "n_routed_experts": 8,
                                           "num_experts_per_tok": 2, "attention_bias": True, "eos_token_id": 1,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                               "partial_rotary_factor": partial or 0.5},
                                           **overrides})
    torch.manual_seed(5)
    ref_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    randomise_correction_bias(ref_model)
    ref_model.save_pretrained(tmp_path)
    if partial is not None:
        raw = json.loads((tmp_path / "config.json").read_text())
        rope = raw.pop("rope_parameters")
        raw.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"])
        (tmp_path / "config.json").write_text(json.dumps(raw))
        assert transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["partial_rotary_factor"] == partial
    engine = moestream.load(tmp_path, device="cpu", dtype="float32")
    ids = torch.randint(2, 160, (2, 15), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = ref_model(ids).logits
    assert (engine.logits(ids) - ref).abs().max() / ref.abs().max() <= 1e-4


def test_prefill_in_chunks_equals_one_pass(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    prompt = torch.randint(2, 160, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = engine.generate(prompt, max_tokens=8, ignore_eos=True)
    engine.runner.prefill_chunk = 7
    assert engine.generate(prompt, max_tokens=8, ignore_eos=True) == whole


def test_fused_qkv_projection_equals_the_three_projections(tiny_checkpoints, monkeypatch):
    """After fuse_qkv, each projection is a view into the concatenated weight (the torch path gives the
    same numbers) and the one-GEMM path gives the same q, k and v."""
    import moestream
    from moestream import kernels

    for arch in ("qwen3_moe", "qwen3_next", "gpt_oss"):
        engine = moestream.load(tiny_checkpoints[arch][0], device="cpu", dtype="float32")
        ids = torch.randint(2, 160, (2, 9), generator=torch.Generator().manual_seed(5))
        before = engine.logits(ids)
        mixer = next(layer.mixer for layer in engine.model.model.layers if hasattr(layer.mixer, "fuse_qkv"))
        x = torch.randn(2, 3, engine.config.hidden_size)
        three = (mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x))
        engine.model.fuse_projections()
        assert mixer.qkv_weight is not None
        assert mixer.q_proj.weight.data_ptr() == mixer.qkv_weight.data_ptr()      # a view, no copy kept
        assert torch.equal(engine.logits(ids), before), arch
        monkeypatch.setattr(kernels, "fused_ops_enabled", lambda t: True)
        for got, want in zip(mixer.project_qkv(x), three):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        monkeypatch.undo()
