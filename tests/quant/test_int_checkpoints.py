"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints read as they are: the same logits and
greedy tokens as transformers on the dequantized weights (fp32, CPU), a bounded bank token-identical
to the resident one, the bytes `check` plans with those the bank holds, and bad input refused in
one sentence."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import moestream
from moestream import cli
from moestream.archs import ARCHS as SPECS
from moestream.errors import CheckpointError, InputError
from moestream.experts.format import ExpertShape
from moestream.quant import QuantSpec, dequantize, quantize
from int_checkpoints import make_int_checkpoint

IDS = torch.randint(2, 160, (2, 21), generator=torch.Generator().manual_seed(9))
MASK = torch.ones_like(IDS)
MASK[1, :6] = 0   # a padded row
PROMPT = IDS[0, :9].tolist()

# (case id, arch, make_int_checkpoint keywords, the expert format moestream holds, its scale dtype)
CASES = [
    ("gptq-int4-sym-v1", "qwen3_moe", dict(method="gptq"), "int4-g32", torch.float16),
    ("gptq-int8-asym-v2", "qwen3_moe", dict(method="gptq", bits=8, group=64, sym=False, v1=False), "int8-g64",
     torch.float32),
    ("gptq-int3-g128", "mixtral", dict(method="gptq", bits=3, group=128, sym=False), "int3-g128", torch.float32),
    ("gptq-int2-channel", "qwen3_moe", dict(method="gptq", bits=2, group=-1, sym=False), "int2-g128",
     torch.float32),
    ("awq-int4", "qwen3_moe", dict(method="awq", sym=False), "int4-g32", torch.float32),
    ("ct-w4a16-sym-bf16", "qwen2_moe", dict(method="compressed-tensors", scale_dtype=torch.bfloat16), "int4-g32",
     torch.bfloat16),
    ("ct-w8a16-asym-channel", "qwen3_moe", dict(method="compressed-tensors", bits=8, group=-1, sym=False),
     "int8-g128", torch.float32),
    ("gptq-int4-mla", "deepseek_v2", dict(method="gptq", group=64, sym=False, v1=False), "int4-g64", torch.float32),
    ("awq-int4-glm", "glm4_moe", dict(method="awq", sym=False, group=64), "int4-g64", torch.float32),
]


@pytest.fixture(scope="module")
def int_checkpoints(tiny_quant_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("intq")
    out = {}
    for case, arch, kw, _, _ in CASES + [("gptq-act-order", "qwen3_moe", dict(method="gptq", sym=False,
                                                                                act_order=True), None, None)]:
        folder, ref = root / case, root / f"{case}-ref"
        make_int_checkpoint(tiny_quant_checkpoints[arch][0], folder, ref, SPECS[arch].moe_prefix, **kw)
        out[case] = (folder, ref)
    return out


def first_moe_layer(engine):
    return engine.config.moe_layers.index(True)


def relative(out, ref):
    valid = MASK.bool()
    return ((out - ref)[valid].abs().max() / ref[valid].abs().max()).item()


@pytest.mark.parametrize("case,arch,kw,held,scale_dtype", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers_on_the_dequantized_weights(int_checkpoints, case, arch, kw, held, scale_dtype):
    folder, ref_folder = int_checkpoints[case]
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    engine = moestream.load(folder, device="cpu", dtype="float32")
    fmt = engine.bank.formats[first_moe_layer(engine)]
    assert engine.plan.kind == "int" and fmt.name == held and fmt.spec.scale_dtype == scale_dtype
    attention = engine.model.model.layers[0].self_attn.o_proj   # dense linears repacked too
    assert type(attention).__name__ == "QuantLinear" and attention.spec == fmt.spec
    with torch.no_grad():
        ref = reference(IDS, attention_mask=MASK).logits
    assert relative(engine.logits(IDS, MASK), ref) <= 1e-4
    with torch.no_grad():
        want = reference.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                                  max_new_tokens=16, do_sample=False)[0, 9:].tolist()
    got = engine.generate(PROMPT, max_tokens=16, ignore_eos=True)
    assert got == want[:len(got)]
    bounded = moestream.load(folder, device="cpu", dtype="float32", capacity=3)
    assert not bounded.plan.memory.fully_resident
    assert bounded.generate(PROMPT, max_tokens=16, ignore_eos=True) == got


def test_bytes_planned_are_the_bytes_held_and_cpu_misses_read_them(int_checkpoints, capsys):
    from moestream.engine.weights import parameter_bytes

    folder, _ = int_checkpoints["gptq-int4-sym-v1"]
    # misses computed on the CPU from the pinned host tier (the C kernel reads the fp16 scales and biases)
    engine = moestream.load(folder, device="cpu", dtype="float32", capacity=3, host_tier="pinned", cpu_misses=1.0)
    resident = moestream.load(folder, device="cpu", dtype="float32")
    assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True) == resident.generate(PROMPT, max_tokens=8,
                                                                                       ignore_eos=True)
    assert engine.stats()["cpu_served"] > 0
    layer = first_moe_layer(engine)
    fmt, shape = engine.bank.formats[layer], ExpertShape.of(engine.config)
    I, H = shape.intermediate, shape.hidden
    # 4-bit codes, one fp16 scale and bias per 32 weights (symmetric: −8·s is exact in fp16): 4 + 32/32 = 5 bits
    assert fmt.nbytes(shape) == 3 * I * H // 2 + 3 * I * H // 32 * 4 == engine.plan.memory.slot_bytes
    held = engine.bank.slots[layer].tensors
    assert sum(t.nbytes for t in held.values()) == 3 * fmt.nbytes(shape)
    moe_layers = sum(engine.config.moe_layers)
    assert engine.bank.tier.nbytes() == moe_layers * engine.config.num_experts * fmt.nbytes(shape)
    assert engine.plan.memory.dense_bytes == parameter_bytes(engine.model, torch.float32)
    assert cli.main(["check", str(folder), "--device", "cpu", "--capacity", "3"]) == 0
    out = capsys.readouterr().out
    assert "gptq int4-g32; experts repacked exactly as int4-g32 (float16 scales and biases)" in out


def test_a_prepacked_bank_of_repacked_experts_warm_starts(int_checkpoints, tmp_path):
    folder, _ = int_checkpoints["awq-int4"]
    snap = tmp_path / "bank"
    cold = moestream.load(folder, device="cpu", dtype="float32", capacity=3, prepack=snap, warmup_tokens=4)
    assert not cold.prepack.loaded and (snap / "bank.json").exists()
    warm = moestream.load(folder, device="cpu", dtype="float32", capacity=3, prepack=snap)
    assert warm.prepack.loaded
    layer = first_moe_layer(warm)
    assert torch.equal(warm.bank.layers[layer].tensors["gate_up.scales"], cold.bank.layers[layer].tensors["gate_up.scales"])
    assert warm.generate(PROMPT, max_tokens=8, ignore_eos=True) == cold.generate(PROMPT, max_tokens=8, ignore_eos=True)


def test_act_order_experts_are_requantized_to_int8_and_attention_dequantized(int_checkpoints, capfd):
    folder, ref_folder = int_checkpoints["gptq-act-order"]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    assert "act-order" in capfd.readouterr().err
    layer = first_moe_layer(engine)
    assert engine.bank.formats[layer].name == "int8-g64"
    assert isinstance(engine.model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    # the oracle: the dequantized weights, the experts' through int8-g64 as moestream holds them
    spec = QuantSpec("int", 8, 64, torch.bfloat16)
    tensors = load_file(str(ref_folder / "model.safetensors"))
    for name, w in tensors.items():
        if ".experts." in name:
            qt = quantize(w, spec)
            tensors[name] = dequantize(qt.qweight, qt.scales, qt.biases, spec)
    requantized = ref_folder.parent / "act-order-requantized"
    requantized.mkdir(exist_ok=True)
    save_file(tensors, str(requantized / "model.safetensors"))
    (requantized / "config.json").write_text((ref_folder / "config.json").read_text())
    reference = transformers.AutoModelForCausalLM.from_pretrained(requantized, dtype=torch.float32).eval()
    exact = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    out = engine.logits(IDS, MASK)
    with torch.no_grad():
        assert relative(out, reference(IDS, attention_mask=MASK).logits) <= 1e-4
        assert relative(out, exact(IDS, attention_mask=MASK).logits) <= 2e-2   # int8's rounding of the experts


def _variant(int_checkpoints, tmp_path, case="gptq-int4-sym-v1", config=None, drop=(), reshape=()):
    """A copy of a written checkpoint with config.json changes, tensors dropped or cut."""
    src, _ = int_checkpoints[case]
    tensors = load_file(str(src / "model.safetensors"))
    for name in drop:
        tensors.pop(name)
    for name in reshape:
        tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"].update(config or {})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("bits", [5, 6])
def test_a_bit_width_we_do_not_read_is_refused(int_checkpoints, tmp_path, capsys, bits):
    folder = _variant(int_checkpoints, tmp_path, config={"bits": bits})
    with pytest.raises(CheckpointError, match=f"{bits}-bit weights"):
        moestream.load(folder, device="cpu", dtype="float32")
    assert cli.main(["run", str(folder), "-p", "3 4", "--max-tokens", "2", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bits}-bit" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("part", ["qzeros", "scales"])
def test_missing_parts_are_named(int_checkpoints, tmp_path, capsys, part):
    name = f"model.layers.0.mlp.experts.3.up_proj.{part}"
    folder = _variant(int_checkpoints, tmp_path, drop=[name])
    with pytest.raises(CheckpointError, match=rf"'{name}' is missing"):
        moestream.load(folder, device="cpu", dtype="float32")
    assert cli.main(["run", str(folder), "-p", "3 4", "--max-tokens", "2", "--device", "cpu"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_missing_expert_is_named_before_loading(int_checkpoints, tmp_path):
    name = "model.layers.2.mlp.experts.7.down_proj.qweight"
    folder = _variant(int_checkpoints, tmp_path, drop=[name])
    with pytest.raises(CheckpointError, match=rf"'{name}' is missing"):
        moestream.load(folder, device="cpu", dtype="float32")


@pytest.mark.parametrize("config,reshape,match", [
    ({"group_size": 64}, (), r"q_proj.qzeros' is int32 \[4, 16\] but .* imply int32 \[2, 16\]"),
    ({}, ("model.layers.0.self_attn.o_proj.scales",), r"o_proj.scales' is float16 \[3, 128\]"),
])
def test_wrong_shapes_are_named(int_checkpoints, tmp_path, config, reshape, match):
    folder = _variant(int_checkpoints, tmp_path, config=config, reshape=reshape)
    with pytest.raises(CheckpointError, match=match):
        moestream.load(folder, device="cpu", dtype="float32")


def test_precision_is_fixed(int_checkpoints):
    with pytest.raises(InputError, match="gptq-quantized checkpoint whose precision is fixed"):
        moestream.load(int_checkpoints["gptq-int4-sym-v1"][0], device="cpu", dtype="float32", experts="int8")


def test_convert_refuses_them(int_checkpoints, tmp_path):
    from moestream.engine.convert import convert
    from moestream.quant.recipe import QuantRecipe

    with pytest.raises(InputError, match="awq-quantized checkpoint; run it as it is"):
        convert(int_checkpoints["awq-int4"][0], tmp_path / "out", QuantRecipe(experts="int4"), progress=False)
