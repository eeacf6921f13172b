"""FP8 e4m3 checkpoints read as they are: experts kept in FP8 in the bank (a byte a weight plus the
scale grid, counted so by the plan) and dense linears in FP8 too, the same logits and tokens as transformers on the dequantized
weights, a bounded bank token-identical to the resident one, and damaged or unsupported FP8 refused
in one sentence with a non-zero exit."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import moestream
from moestream import cli
from moestream.errors import CheckpointError
from moestream.engine.weights import parameter_bytes
from moestream.experts.format import Fp8Format
from moestream.model.quant_linear import QuantLinear
from moestream.quant.fp8 import Fp8Spec
from fp8_models import make_fp8_checkpoint
from engine_probes import assert_fetch_cpu_share_scores

IDS = torch.randint(2, 160, (2, 21), generator=torch.Generator().manual_seed(9))
MASK = torch.ones_like(IDS)
MASK[1, :6] = 0   # a padded row

# (arch, spec): ragged 12 x 12 blocks over 32- and 16-wide weights (the gate's last block rows 4 of
# 12, so gate_up's grid is two grids), DeepSeek-V3 in its own block form, the compressed-tensors
# channel and tensor forms (bf16 scales, as llm-compressor saves them), Qwen3-Next's hybrid layers.
CASES = {
    "qwen3_moe-block": ("qwen3_moe", Fp8Spec(12, 12), torch.float32),
    "deepseek_v3-block": ("deepseek_v3", Fp8Spec(16, 8), torch.float32),
    "qwen3_moe-channel": ("qwen3_moe", Fp8Spec(1, None, "weight_scale"), torch.bfloat16),
    "mixtral-tensor": ("mixtral", Fp8Spec(None, None, "weight_scale"), torch.float32),
    "qwen3_next-block": ("qwen3_next", Fp8Spec(16, 16), torch.float32),   # linear attention, shared experts
}
PREFIX = {"qwen3_moe": "mlp", "deepseek_v3": "mlp", "mixtral": "block_sparse_moe", "qwen3_next": "mlp"}


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for case, (arch, spec, scale_dtype) in CASES.items():
        folder, ref = root / case, root / f"{case}-ref"
        make_fp8_checkpoint(tiny_checkpoints[arch][0], folder, ref, spec, PREFIX[arch], scale_dtype)
        out[case] = (folder, transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval())
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fp8_checkpoints, case):
    folder, reference = fp8_checkpoints[case]
    spec = CASES[case][1]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    layer = engine.config.moe_layers.index(True)
    fmt = engine.bank.formats[layer]
    assert engine.plan.kind == "fp8" and isinstance(fmt, Fp8Format) and fmt.spec == spec
    H, I = engine.config.hidden_size, engine.config.moe_intermediate
    expert_bytes = spec.nbytes(I, H) * 2 + spec.nbytes(H, I)   # a byte a weight + float32 scales
    assert fmt.nbytes(engine.bank.store.shape) == expert_bytes
    assert engine.plan.memory.slot_bytes == expert_bytes
    fp8_linears = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]   # dense linears kept FP8
    assert fp8_linears and all(m.spec == spec and m.qweight.dtype == torch.uint8 for m in fp8_linears)
    assert any(".self_attn." in path for path, m in engine.model.named_modules() if isinstance(m, QuantLinear))
    assert engine.plan.memory.dense_bytes == parameter_bytes(engine.model, torch.float32)   # counted as stored
    with torch.no_grad():
        ref = reference(IDS, attention_mask=MASK).logits
    out = engine.logits(IDS, MASK)
    valid = MASK.bool()
    assert (out - ref)[valid].abs().max() / ref[valid].abs().max() <= 1e-4
    prompt = IDS[0, :9].tolist()
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                                  max_new_tokens=16, do_sample=False)[0, 9:].tolist()
    got = engine.generate(prompt, max_tokens=16, ignore_eos=True)
    assert got == want[:len(got)] and len(got) == 16
    bounded = moestream.load(folder, device="cpu", dtype="float32", capacity=3, miss_policy="fetch")
    assert not bounded.plan.memory.fully_resident
    assert bounded.generate(prompt, max_tokens=16, ignore_eos=True) == got


def test_fp8_checkpoint_requantized_on_load_as_its_dequantized_weights_would_be(fp8_checkpoints):
    """--experts / --attention on an FP8 checkpoint quantize the weights its FP8 values stand for: the
    same model as the same recipe over the dequantized checkpoint."""
    folder = fp8_checkpoints["qwen3_moe-block"][0]
    kw = dict(device="cpu", dtype="float32", experts="int8", attention="int4", capacity=5)
    fp8 = moestream.load(folder, **kw)
    dequantized = moestream.load(folder.parent / f"{folder.name}-ref", **kw)
    assert fp8.plan.kind == "fp8" and fp8.bank.formats[0].name == "int8-g64"
    attention = fp8.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(attention, QuantLinear) and attention.spec.name == "int4-g64"
    dense_mlp = fp8.model.get_submodule("model.layers.1.mlp.down_proj")   # not in the recipe: stays FP8
    assert isinstance(dense_mlp, QuantLinear) and dense_mlp.spec == CASES["qwen3_moe-block"][1]
    assert torch.equal(fp8.logits(IDS, MASK), dequantized.logits(IDS, MASK))
    prompt = IDS[0, :9].tolist()
    assert fp8.generate(prompt, max_tokens=12, ignore_eos=True) == dequantized.generate(prompt, max_tokens=12,
                                                                                      ignore_eos=True)
    # experts asked for in the compute dtype by name: dequantized into the dense format (what the CPU
    # worker of the hybrid policy reads)
    dense = moestream.load(folder, device="cpu", dtype="float32", experts="fp32", capacity=5)
    assert dense.bank.formats[0].name == "fp32"
    assert torch.equal(dense.logits(IDS, MASK), moestream.load(folder.parent / f"{folder.name}-ref", device="cpu",
                                                                dtype="float32", capacity=5).logits(IDS, MASK))


def _damaged(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


EXPERT = "model.layers.0.mlp.experts.3.up_proj"
DENSE = "model.layers.1.mlp.down_proj"   # layer 1 is a dense MLP in the tiny qwen3_moe


@pytest.mark.parametrize("what, edit_tensors, edit_config, fragments", [
    ("missing expert scale", lambda t: t.pop(f"{EXPERT}.weight_scale_inv"), None,
     [f"{EXPERT}.weight_scale_inv", "is missing"]),
    ("missing dense scale", lambda t: t.pop(f"{DENSE}.weight_scale_inv"), None, [f"{DENSE}.weight_scale_inv", "is missing"]),
    ("scale of the wrong shape", lambda t: t.update({f"{EXPERT}.weight_scale_inv": torch.ones(3, 3)}), None,
     [f"{EXPERT}.weight_scale_inv", "[3, 3]", "needs float32 [2, 3]"]),
    ("static activation scale tensor", lambda t: t.update({f"{EXPERT}.input_scale": torch.ones(1)}), None,
     ["static activation scale", f"{EXPERT}.input_scale"]),
    ("static activation scheme", None, lambda c: c["quantization_config"].update(activation_scheme="static"),
     ["static activation scales", "activation_scheme"]),
    ("expert weight not in fp8", lambda t: t.update({f"{EXPERT}.weight": t[f"{EXPERT}.weight"].float()}), None,
     [f"{EXPERT}.weight", "float32", "float8_e4m3fn"]),
])
def test_damaged_fp8_checkpoint_refused_in_one_line(fp8_checkpoints, tmp_path, capsys, what, edit_tensors,
                                                    edit_config, fragments):
    folder = _damaged(fp8_checkpoints["qwen3_moe-block"][0], tmp_path / "bad", edit_tensors, edit_config)
    with pytest.raises(CheckpointError) as info:
        moestream.load(folder, device="cpu", dtype="float32")
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    capsys.readouterr()
    rc = cli.main(["check", str(folder), "--device", "cpu"] if what.startswith("static activation scheme")
                  else ["run", str(folder), "-p", "3 4 5", "--max-tokens", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in err and err.count("\n") == 1 and err.startswith("moestream: error: "), err
    assert all(f in err for f in fragments)


@pytest.mark.parametrize("case", ["qwen3_moe-block", "qwen3_moe-channel", "mixtral-tensor"])
def test_hybrid_misses_of_fp8_experts_give_the_resident_tokens(fp8_checkpoints, case):
    """The hybrid policy's CPU worker reads FP8 experts as the pinned tier holds them (e4m3 bytes and
    scale grids: ragged blocks, per channel, per tensor): a small bank gives the resident tokens, the
    CPU computing misses (its counters say so) beside the in-place reads."""
    folder = fp8_checkpoints[case][0]
    prompt, ids = IDS[0, :9].tolist(), IDS[1].tolist()
    resident = moestream.load(folder, device="cpu", dtype="float32")
    want, want_logp = resident.generate(prompt, max_tokens=12, ignore_eos=True), resident.teacher_forced(ids[:6], ids[6:])
    for share in ("auto", 1.0):
        engine = moestream.load(folder, device="cpu", dtype="float32", capacity=2, miss_policy="hybrid",
                                host_tier="pinned", cpu_misses=share, discovery=False)
        try:
            assert engine.bank.miss_policy == "hybrid" and not engine.plan.memory.fully_resident
            torch.testing.assert_close(engine.teacher_forced(ids[:6], ids[6:]), want_logp, rtol=1e-4, atol=1e-4)
            stats = engine.stats()   # the scores came with misses, some computed by the CPU worker
            assert stats["cpu_served"] > 0 and stats["cpu_bytes"] > 0, stats
            assert engine.generate(prompt, max_tokens=12, ignore_eos=True) == want, share
        finally:
            engine.close()
    # the fetch policy's --cpu-misses computes its share with the same kernel (`host_dispatch`)
    assert_fetch_cpu_share_scores(folder, 2, ids[:6], ids[6:], want_logp)


def test_auto_takes_hybrid_for_fp8_experts_where_it_runs(fp8_checkpoints):
    """Nothing about FP8 experts stands in the hybrid policy's way any more: where the plan runs on a
    GPU with the pinned tier, `auto` finds no reason against it."""
    from moestream.engine.build import hybrid_refusal
    from moestream.experts.format import ExpertShape
    from moestream.experts.hybrid import check_hybrid

    folder = fp8_checkpoints["qwen3_moe-block"][0]
    check_hybrid({0: Fp8Format(Fp8Spec(12, 12), torch.float32)}, ExpertShape(32, 16), host_stacks={})
    engine = moestream.load(folder, device="cpu", dtype="float32", capacity=3)

    class OnGpu:   # the plan as a GPU's would be, with the pinned tier
        memory, device = engine.plan.memory, torch.device("cuda")

    class Tier:
        layers = {0: {}}

    assert hybrid_refusal(OnGpu, moestream.EngineConfig(model=str(folder)), engine.bank.store, engine.bank.formats,
                          Tier, sharded=False) is None


def test_fp8_bank_prepacks_and_warm_starts_with_its_bytes(fp8_checkpoints, tmp_path):
    """A prepacked snapshot of an FP8 bank holds the FP8 bytes and scales, and a warm start from it
    decodes the same tokens."""
    folder = fp8_checkpoints["qwen3_moe-block"][0]
    snap, prompt = tmp_path / "bank", IDS[0, :9].tolist()
    cold = moestream.load(folder, device="cpu", dtype="float32", capacity=3, prepack=snap, warmup_tokens=6)
    assert not cold.prepack.loaded and (snap / "bank.json").exists() and cold.prepack_error is None
    warm = moestream.load(folder, device="cpu", dtype="float32", capacity=3, prepack=snap)
    assert warm.prepack.loaded
    for layer in cold.bank.layers:
        tensors = warm.bank.layers[layer].tensors
        assert tensors["gate_up.qweight"].dtype == torch.uint8 and tensors["down.scales"].dtype == torch.float32
        for name, t in tensors.items():
            assert torch.equal(t, cold.bank.layers[layer].tensors[name]), name
    assert warm.generate(prompt, max_tokens=12, ignore_eos=True) == cold.generate(prompt, max_tokens=12, ignore_eos=True)


def test_convert_of_an_fp8_checkpoint_is_that_of_its_dequantized_weights(fp8_checkpoints, tmp_path):
    """`moestream convert` of an FP8 checkpoint writes the packed checkpoint its dequantized export
    gives, byte for byte (experts and dense tensors), and it runs."""
    from moestream.engine.convert import convert
    from moestream.quant.recipe import QuantRecipe

    folder = fp8_checkpoints["qwen3_moe-block"][0]
    recipe = QuantRecipe(experts="int4", attention="int8")
    convert(folder, tmp_path / "from-fp8", recipe, dtype="fp32", device="cpu", progress=False)
    convert(folder.parent / f"{folder.name}-ref", tmp_path / "from-ref", recipe, dtype="fp32", device="cpu",
            progress=False)
    ours = sorted(p.relative_to(tmp_path / "from-fp8") for p in (tmp_path / "from-fp8").rglob("*.bin"))
    assert ours and ours == sorted(p.relative_to(tmp_path / "from-ref") for p in (tmp_path / "from-ref").rglob("*.bin"))
    for rel in [*ours, "model.safetensors"]:
        assert (tmp_path / "from-fp8" / rel).read_bytes() == (tmp_path / "from-ref" / rel).read_bytes(), rel
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("from-fp8", "from-ref")]
    assert configs[0] == configs[1] and "quantization_config" not in configs[0]
    engine = moestream.load(tmp_path / "from-fp8", device="cpu", dtype="float32")
    assert engine.plan.kind == "packed" and engine.bank.formats[0].name == "int4-g64"
    assert len(engine.generate(IDS[0, :9].tolist(), max_tokens=4, ignore_eos=True)) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["qwen3_moe-block", "deepseek_v3-block"])
def test_fp8_checkpoint_on_the_gpu(fp8_checkpoints, case):
    """On CUDA the FP8 experts and linears run the Triton kernels: close to the fp32 CPU reference,
    and a bounded fetch bank decodes the resident bank's tokens."""
    folder, reference = fp8_checkpoints[case]
    engine = moestream.load(folder, device="cuda", dtype="bfloat16")
    assert engine.bank.formats[engine.config.moe_layers.index(True)].uses_kernels(torch.device("cuda"))
    with torch.no_grad():
        ref = reference(IDS, attention_mask=MASK).logits
    out = engine.logits(IDS.cuda(), MASK.cuda()).float().cpu()
    valid = MASK.bool()
    assert (out - ref)[valid].abs().max() / ref[valid].abs().max() <= 3e-2
    prompt = IDS[0, :9].tolist()
    resident = engine.generate(prompt, max_tokens=16, ignore_eos=True)
    bounded = moestream.load(folder, device="cuda", dtype="bfloat16", capacity=3, miss_policy="fetch")
    assert bounded.generate(prompt, max_tokens=16, ignore_eos=True) == resident


def test_convert_without_experts_keeps_the_fp8_experts_in_the_packed_records(fp8_checkpoints, tmp_path, capsys):
    """An FP8 checkpoint converted without --experts keeps each expert's FP8 bytes and scales in its
    packed record (one read per missing expert); it runs as the FP8 checkpoint does."""
    from safetensors.torch import load_file

    folder = fp8_checkpoints["qwen3_moe-block"][0]
    assert cli.main(["convert", str(folder), str(tmp_path / "packed"), "--dtype", "fp32", "--device", "cpu"]) == 0
    layout = json.loads((tmp_path / "packed" / "layout.json").read_text())
    assert {rec["format"] for rec in layout["layers"].values()} == {"fp8-b12x12"}
    packed = moestream.load(tmp_path / "packed", device="cpu", dtype="float32", capacity=3)
    direct = moestream.load(folder, device="cpu", dtype="float32", capacity=3)
    assert packed.plan.kind == "packed" and isinstance(packed.bank.formats[0], Fp8Format)
    assert packed.plan.memory.slot_bytes == direct.plan.memory.slot_bytes
    source = load_file(str(folder / "model.safetensors"))
    expert = {name: t[0] for name, t in packed.bank.formats[0].empty(packed.bank.store.shape, 1).items()}
    packed.bank.store.read_into(0, 5, packed.bank.formats[0], expert)
    up = source["model.layers.0.mlp.experts.5.up_proj.weight"].view(torch.uint8)
    assert torch.equal(expert["gate_up.qweight"][16:], up)
    assert torch.equal(expert["down.scales"], source["model.layers.0.mlp.experts.5.down_proj.weight_scale_inv"])
    assert torch.equal(packed.logits(IDS, MASK), direct.logits(IDS, MASK))
    prompt = IDS[0, :9].tolist()
    assert packed.generate(prompt, max_tokens=12, ignore_eos=True) == direct.generate(prompt, max_tokens=12,
                                                                                    ignore_eos=True)


def test_check_says_which_format_holds_the_experts_of_an_fp8_checkpoint(fp8_checkpoints, capsys):
    """As stored, `check` says the FP8 bytes are kept; with --experts int4 it names the format they are
    quantized to at load instead of claiming they are kept."""
    folder = fp8_checkpoints["qwen3_moe-block"][0]
    assert cli.main(["check", str(folder), "--device", "cpu"]) == 0
    assert "fp8-b12x12, kept as stored" in capsys.readouterr().out
    assert cli.main(["check", str(folder), "--device", "cpu", "--experts", "int4"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("experts "))
    assert "held as int4" in line and "kept as stored" not in line
