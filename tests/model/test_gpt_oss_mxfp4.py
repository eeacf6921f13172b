"""gpt-oss checkpoints as they ship: experts in MXFP4 (`*_blocks` + `*_scales`, biases, gate/up rows
interleaved), read and held in their bytes. The tiny checkpoint is written here (its experts quantized
by hand), and transformers loads the same files with `Mxfp4Config(dequantize=True)` as the oracle:
logits, greedy tokens, a bounded bank equal to resident, the bytes the plan counts, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import moestream
from moestream.errors import CheckpointError, InputError
from moestream.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tiny_models import follow_config_swiglu, make_tiny_checkpoint
from engine_probes import assert_fetch_cpu_share_scores

H, I, E = 64, 32, 8   # MXFP4 needs both widths in whole 32-value blocks
QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}


def write_mxfp4(folder, layers: int) -> None:
    """Replace the stacked bf16/fp32 experts of a gpt-oss checkpoint by MXFP4 blocks and scales, laid out
    as the published checkpoints are ((E, N, K/32, 16) with N the output rows, gate/up interleaved)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    for layer in range(layers):
        base = f"model.layers.{layer}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = quantize_mxfp4(tensors.pop(f"{base}.{proj}").transpose(1, 2))   # (E, K, N) → rows N
            tensors[f"{base}.{proj}_blocks"], tensors[f"{base}.{proj}_scales"] = blocks, scales
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = QUANT
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    folder = root / "mxfp4"
    made = make_tiny_checkpoint("gpt_oss", root / "bf16", hidden_size=H, intermediate_size=I)
    shutil.copytree(root / "bf16", folder)
    write_mxfp4(folder, made.config.num_hidden_layers)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    return folder, follow_config_swiglu(ref)


def test_logits_match_transformers_mxfp4_loading(mxfp4_gpt_oss):
    folder, ref_model = mxfp4_gpt_oss
    engine = moestream.load(folder, device="cpu", dtype="float32")
    ids = torch.randint(2, 160, (2, 17), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask).logits
    out = engine.logits(ids, mask)
    real = mask.bool()
    assert (out - ref)[real].abs().max() / ref[real].abs().max() <= 1e-4
    # the slots hold the stored bytes, gate rows first: expert 5 of layer 2 is the checkpoint's rows permuted
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model.safetensors"))
    slots = engine.bank.slots[2]
    slot = int(slots.slot_map[5])
    blocks = stored["model.layers.2.mlp.experts.gate_up_proj_blocks"][5].reshape(2 * I, H // 2)
    assert torch.equal(slots.tensors["gate_up.blocks"][slot], torch.cat([blocks[0::2], blocks[1::2]]))
    scales = stored["model.layers.2.mlp.experts.down_proj_scales"][5]
    assert torch.equal(slots.tensors["down.scales"][slot], scales)
    bias = stored["model.layers.2.mlp.experts.gate_up_proj_bias"][5]
    assert torch.equal(slots.tensors["gate_up_bias"][slot], torch.cat([bias[0::2], bias[1::2]]))


def test_greedy_tokens_match_and_a_bounded_bank_equals_resident(mxfp4_gpt_oss):
    folder, ref_model = mxfp4_gpt_oss
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 14)]
    expected = []
    for p in prompts:
        out = ref_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=12, min_new_tokens=12, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    resident = moestream.load(folder, device="cpu", dtype="float32")
    assert resident.generate(prompts, max_tokens=12, ignore_eos=True) == expected
    bounded = moestream.load(folder, device="cpu", dtype="float32", capacity=3)
    assert bounded.bank.capacity == 3
    assert bounded.generate(prompts, max_tokens=12, ignore_eos=True) == expected
    # misses computed where they sit in host RAM (the C kernel over the host tier's MXFP4 stacks)
    host = moestream.load(folder, device="cpu", dtype="float32", capacity=3, host_tier="pinned", cpu_misses=1.0)
    assert host.generate(prompts, max_tokens=12, ignore_eos=True) == expected


def test_the_plan_counts_the_stored_bytes(mxfp4_gpt_oss):
    from moestream.engine.config import EngineConfig
    from moestream.engine.plan import plan_load

    folder, _ = mxfp4_gpt_oss
    plan = plan_load(EngineConfig.from_kwargs(folder, device="cpu", dtype="float32"))
    assert plan.kind == "mxfp4"
    codes, scales, biases = (2 * I * H + H * I) // 2, (2 * I * H + H * I) // 32, (2 * I + H) * 4
    assert set(plan.memory.layer_slot_bytes) == {codes + scales + biases}


def _copy(folder, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(folder, out)
    return out


def _edit_tensors(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"),
     r"down_proj_scales' is missing.*_blocks and _scales"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_scales":
                         t["model.layers.0.mlp.experts.gate_up_proj_scales"][:, :, :1].contiguous()}),
     r"gate_up_proj_scales' is uint8 of shape \[8, 64, 1\].*shape \[8, 64, 2\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj_blocks": torch.zeros(32, 2, 16, dtype=torch.uint8)}),
     r"q_proj_blocks' is MXFP4-quantized, but moestream reads MXFP4 for the routed experts only"),
])
def test_missing_misshapen_or_misplaced_mxfp4_tensors_are_one_sentence(mxfp4_gpt_oss, tmp_path, edit, match):
    folder = _copy(mxfp4_gpt_oss[0], tmp_path)
    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError, match=match) as info:
        moestream.load(folder, device="cpu", dtype="float32")
    assert str(info.value).count(". ") == 0 and str(info.value).endswith(".")


def test_an_mxfp4_config_over_unquantized_experts_is_refused(mxfp4_gpt_oss, tmp_path):
    folder = _copy(mxfp4_gpt_oss[0].parent / "bf16", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    with pytest.raises(CheckpointError, match=r"stored unquantized although config.json says the experts are MXFP4; "
                                              r"remove quantization_config") as info:
        moestream.load(folder, device="cpu", dtype="float32")
    assert str(info.value).count(". ") == 0 and str(info.value).endswith(".")


def test_a_fixed_precision_is_not_requantized(mxfp4_gpt_oss):
    with pytest.raises(InputError, match="MXFP4-quantized checkpoint whose precision is fixed"):
        moestream.load(mxfp4_gpt_oss[0], device="cpu", experts="int4")


def test_reference_dispatch_is_dequantize_then_the_dense_reference():
    from moestream.kernels.moe_reference import Activation, moe_reference
    from moestream.kernels.mxfp4_moe import mxfp4_moe_reference

    g = torch.Generator().manual_seed(3)
    S, T, k = 4, 5, 2
    gu_b, gu_s = quantize_mxfp4(torch.randn(S, 2 * I, H, generator=g))
    d_b, d_s = quantize_mxfp4(torch.randn(S, H, I, generator=g))
    slots = {"gate_up.blocks": gu_b.reshape(S, 2 * I, H // 2), "gate_up.scales": gu_s,
             "down.blocks": d_b.reshape(S, H, I // 2), "down.scales": d_s,
             "gate_up_bias": torch.randn(S, 2 * I, generator=g), "down_bias": torch.randn(S, H, generator=g)}
    hidden, weights = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    ids = torch.randint(0, S, (T, k), generator=g)
    ids[0, 1] = -1
    act = Activation("swiglu_clamped", 1.702, 7.0)
    want = moe_reference(hidden, dequantize_mxfp4(gu_b, gu_s), dequantize_mxfp4(d_b, d_s), ids, weights, act,
                         slots["gate_up_bias"], slots["down_bias"])
    assert torch.equal(mxfp4_moe_reference(hidden, slots, ids, weights, act), want)


def test_convert_says_to_run_the_checkpoint_as_it_is(mxfp4_gpt_oss, tmp_path):
    from moestream.engine.convert import Converter
    from moestream.quant.recipe import QuantRecipe

    with pytest.raises(InputError, match="MXFP4-quantized checkpoint; run it as it is") as info:
        Converter(mxfp4_gpt_oss[0], tmp_path / "out", QuantRecipe.from_dict({"experts": "int4"}))
    assert str(info.value).count(". ") == 0 and not (tmp_path / "out").exists()


def test_cli_convert_without_experts_names_the_mxfp4_checkpoint(mxfp4_gpt_oss, tmp_path, capsys):
    """Asking for --experts would mislead (an MXFP4 checkpoint is not converted at all): the
    refusal names the format, in one line."""
    from moestream import cli

    assert cli.main(["convert", str(mxfp4_gpt_oss[0]), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "MXFP4-quantized checkpoint; run it as it is" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_hybrid_misses_of_mxfp4_experts_give_the_resident_tokens(mxfp4_gpt_oss, capsys):
    """The hybrid policy's CPU worker reads MXFP4 experts as the pinned tier holds them (e2m1 codes, e8m0
    scales, the biases, the clamped SwiGLU): a small bank gives the resident tokens with every miss
    computed on the CPU (its counters say so), `auto` finds nothing against it where it runs, and
    `check` names the format."""
    from moestream import cli
    from moestream.engine.build import hybrid_refusal

    folder = mxfp4_gpt_oss[0]
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 12)]
    resident = moestream.load(folder, device="cpu", dtype="float32")
    want = resident.generate(prompts, max_tokens=10, ignore_eos=True)
    ids = torch.randint(2, 160, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    want_logp = resident.teacher_forced(ids[:8], ids[8:])   # the tiny model's greedy tokens repeat: scores tell more
    engine = moestream.load(folder, device="cpu", dtype="float32", capacity=3, miss_policy="hybrid",
                            host_tier="pinned", discovery=False)
    try:
        assert engine.bank.miss_policy == "hybrid" and not engine.bank.hybrid_misses.gpu_reads
        torch.testing.assert_close(engine.teacher_forced(ids[:8], ids[8:]), want_logp, rtol=1e-4, atol=1e-4)
        stats = engine.stats()   # the scores came with misses, all computed by the CPU worker
        assert stats["cpu_served"] == stats["misses"] > 0 and stats["cpu_bytes"] > 0, stats
        assert engine.generate(prompts, max_tokens=10, ignore_eos=True) == want            # a batch of two
        assert [engine.generate(p, max_tokens=10, ignore_eos=True) for p in prompts] == want   # alone
    finally:
        engine.close()
    # the fetch policy's --cpu-misses computes its share with the same kernel (`host_dispatch`)
    assert_fetch_cpu_share_scores(folder, 3, ids[:8], ids[8:], want_logp)

    class OnGpu:   # the plan as a GPU's would be, with the pinned tier
        memory, device = engine.plan.memory, torch.device("cuda")

    class Tier:
        layers = {0: {}}

    assert hybrid_refusal(OnGpu, moestream.EngineConfig(model=str(folder)), engine.bank.store, engine.bank.formats,
                          Tier, sharded=False) is None
    assert cli.main(["check", str(folder), "--device", "cpu"]) == 0
    assert "MXFP4, kept as stored" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_kernels_match_and_a_bounded_bank_equals_resident(mxfp4_gpt_oss):
    """In fp32 the CUDA path (80 tokens: the grouped MXFP4 kernels, the fused norms, rotary and router)
    gives the CPU engine's logits, which the test above holds to transformers' (where the installed
    transformers reads this tiny config's YaRN rope as ours does: 5.17 does not, on the CPU too, so the
    GPU's oracle is our CPU path). In bf16 this tiny model's router has near-ties of 0.01 between its
    second and third logits (about 2, where bf16 steps by 0.016), so a last-bit difference anywhere moves a
    token to another expert: transformers' own bf16 is 0.7% to 4.9% off its fp32 over a dozen input draws,
    the total swinging with the one to three tokens whose choice flips (10% to 37% off each). A kernel that
    computes wrongly is off on every token: the median token is held to 2% (0.7% on the CPU)."""
    folder, _ = mxfp4_gpt_oss
    ids = torch.randint(2, 160, (2, 40), generator=torch.Generator().manual_seed(2))   # > 16 tokens: grouped
    ref = moestream.load(folder, device="cpu", dtype="float32").logits(ids)
    exact = moestream.load(folder, device="cuda", dtype="float32")
    out = exact.logits(ids.cuda()).cpu()
    assert (out - ref).abs().max() / ref.abs().max() <= 1e-4
    resident = moestream.load(folder, device="cuda", dtype="bfloat16")
    for engine in (exact, resident):
        assert all(fmt.uses_kernels(torch.device("cuda"), engine.bank.store.shape)
                   for fmt in engine.bank.formats.values())
    out = resident.logits(ids.cuda()).float().cpu()
    per_token = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_token.median() < 2e-2, per_token
    prompts = [ids[0, :9].tolist(), ids[1, :30].tolist()]
    tokens = resident.generate(prompts, max_tokens=12, ignore_eos=True)
    bounded = moestream.load(folder, device="cuda", dtype="bfloat16", capacity=3)
    assert bounded.generate(prompts, max_tokens=12, ignore_eos=True) == tokens


def test_prepacked_snapshots_and_profiles_hold_the_mxfp4_bank(mxfp4_gpt_oss, tmp_path):
    from moestream.warmstart.profile import record_profile

    folder, _ = mxfp4_gpt_oss
    prompt = torch.randint(2, 160, (20,), generator=torch.Generator().manual_seed(11)).tolist()
    snap = tmp_path / "bank"
    cold = moestream.load(folder, device="cpu", dtype="float32", capacity=3, prepack=snap, warmup_tokens=6)
    assert cold.prepack_error is None and (snap / "bank.json").exists()
    warm = moestream.load(folder, device="cpu", dtype="float32", capacity=3, prepack=snap)
    assert warm.prepack.loaded
    for layer in cold.bank.layers:
        assert torch.equal(warm.bank.layers[layer].tensors["gate_up.blocks"],
                           cold.bank.layers[layer].tensors["gate_up.blocks"])
    tokens = cold.generate(prompt, max_tokens=10, ignore_eos=True)
    assert warm.generate(prompt, max_tokens=10, ignore_eos=True) == tokens
    path = tmp_path / "profile.json"
    record_profile(cold, [prompt], max_tokens=3).save(path)
    pinned = moestream.load(folder, device="cpu", dtype="float32", capacity=3, profile=path, pin_top_k=1)
    assert all(len(v) == 1 for v in pinned.bank.policy.pinned.values())
    assert pinned.generate(prompt, max_tokens=10, ignore_eos=True) == tokens
