"""Quantized experts in the bank: exact offload in every format, quantize-on-load, budgets, snapshots."""

import pytest
import torch

import moestream
from moestream.engine.plan import plan_memory
from moestream.errors import InputError
from moestream.experts.format import ExpertShape, QuantizedFormat
from moestream.quant import parse_quant

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 19)]
FORMATS = ["int8", "int4", "int4-g32", "int3", "int2", "nf4", "nf3"]


def _load(folder, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fetch_at_every_capacity_equals_full_residency(tiny_quant, fmt):
    full = _load(tiny_quant, experts=fmt)
    expected = full.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    for capacity in (2, 3, 5):
        engine = _load(tiny_quant, experts=fmt, capacity=capacity)
        engine.runner.prefill_chunk = 8   # long prompts take the staged path too
        assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == expected, capacity
        assert engine.stats()["misses"] > 0


def test_quantized_slots_hold_the_formats_tensors(tiny_quant):
    engine = _load(tiny_quant, experts="int4-g32", capacity=3)
    slots = engine.bank.layers[0].tensors
    assert set(slots) == {f"{p}.{t}" for p in ("gate_up", "down") for t in ("qweight", "scales", "biases")}
    assert slots["gate_up.qweight"].shape == (3, 128, 64) and slots["gate_up.qweight"].dtype == torch.uint8
    assert slots["down.scales"].shape == (3, 128, 2)
    nf = _load(tiny_quant, experts="nf4", capacity=3).bank.layers[0].tensors
    assert "gate_up.biases" not in nf


def test_quantized_logits_stay_close_to_full_precision(tiny_quant):
    ids = torch.randint(2, 160, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = _load(tiny_quant).logits(ids)
    for fmt, bound in (("int8", 0.02), ("int4", 0.2)):
        out = _load(tiny_quant, experts=fmt).logits(ids)
        assert (out - ref).norm() / ref.norm() < bound, fmt


def test_the_plan_counts_quantized_slots_and_fits_more_experts(tiny_quant):
    engine = _load(tiny_quant, capacity=2)
    config = engine.config
    shape = ExpertShape(config.hidden_size, config.moe_intermediate)
    int4 = QuantizedFormat(parse_quant("int4"), torch.float32)
    formats = {layer: int4 for layer in engine.bank.layers}
    bf = plan_memory(config, torch.float32, capacity=4, max_context=256)
    q4 = plan_memory(config, torch.float32, capacity=4, max_context=256, expert_formats=formats)
    q4_bank = _load(tiny_quant, experts="int4", capacity=2).bank
    assert q4.slot_bytes == int4.nbytes(shape) == sum(t.nbytes for t in q4_bank.layers[0].tensors.values()) // 2
    assert q4.bank_bytes == 4 * 2 * int4.nbytes(shape) and q4.bank_bytes < bf.bank_bytes / 6
    budget = bf.total_bytes   # what fp32 capacity 4 needs holds more int4 experts
    assert plan_memory(config, torch.float32, budget=budget, max_context=256, expert_formats=formats).capacity > 4


def test_the_plan_holds_a_layer_dequantized_only_for_chunks_that_take_the_long_prompts_path(tiny_quant):
    """Chunks from the threshold on dequantize a layer's slots at once (kernels/long_prompts.py): the
    plan holds that copy (every expert of a layer, in the compute dtype) then, and only then."""
    from moestream.kernels.long_prompts import BYTE_MIN_TOKENS, PACKED_MIN_TOKENS
    from moestream.quant.fp8 import parse_fp8
    from moestream.experts.format import Fp8Format

    config = _load(tiny_quant, capacity=2).config
    copy = config.num_experts * 3 * config.hidden_size * config.moe_intermediate * 4   # fp32
    layers = [i for i, moe in enumerate(config.moe_layers) if moe]

    def workspace(fmt, chunk):
        formats = {layer: fmt for layer in layers} if fmt is not None else None
        return plan_memory(config, torch.float32, capacity=4, max_context=256, prefill_chunk=chunk,
                           expert_formats=formats).workspace_bytes

    int4, fp8 = QuantizedFormat(parse_quant("int4"), torch.float32), Fp8Format(parse_fp8("fp8-b16x16"), torch.float32)
    for fmt, first in ((int4, PACKED_MIN_TOKENS), (fp8, BYTE_MIN_TOKENS)):
        assert workspace(fmt, first - 1) == workspace(None, first - 1)
        assert workspace(fmt, first) == workspace(None, first) + copy
    assert workspace(int4, BYTE_MIN_TOKENS) - workspace(fp8, BYTE_MIN_TOKENS) == 0


def test_per_layer_formats(tiny_quant):
    engine = _load(tiny_quant, experts="int4", layer_formats={-1: "int8"}, capacity=3)
    assert engine.bank.formats[0].name == "int4-g64" and engine.bank.formats[2].name == "int8-g64"
    full = _load(tiny_quant, experts="int4", layer_formats={-1: "int8"})
    assert engine.generate(PROMPTS[1], max_tokens=10, ignore_eos=True) == full.generate(PROMPTS[1], max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("kw,match", [({"experts": "int5"}, "unknown"), ({"experts": "int4-g96"}, "group size 96"),
                                      ({"experts": "bf16"}, "--dtype bf16")])
def test_bad_expert_formats_are_refused(tiny_quant, kw, match):
    with pytest.raises(InputError, match=match):
        _load(tiny_quant, **kw)


def test_prepack_snapshot_records_the_format(tiny_quant, tmp_path):
    snap = tmp_path / "bank"
    cold = _load(tiny_quant, experts="int4", capacity=3, prepack=snap, warmup_tokens=4)
    assert not cold.prepack.loaded
    warm = _load(tiny_quant, experts="int4", capacity=3, prepack=snap)
    assert warm.prepack.loaded
    other = _load(tiny_quant, experts="int8", capacity=3, prepack=snap)
    assert not other.prepack.loaded and "expert_formats" in other.prepack.reason


@pytest.mark.parametrize("fmt", ["int4", "int8", "nf4", "int3"])   # int3: the plain-torch path
def test_hybrid_misses_of_quantized_experts_give_the_resident_tokens(tiny_quant, fmt):
    """Quantized experts computed on the CPU from the pinned tier (the C kernel unpacks them where it
    reads the format) give the tokens of the fully resident quantized model."""
    full = _load(tiny_quant, experts=fmt)
    expected = full.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    engine = _load(tiny_quant, experts=fmt, capacity=2 * full.config.top_k, host_tier="pinned", cpu_misses=1.0,
                   discovery=False)
    assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == expected             # batched decode
    assert [engine.generate(p, max_tokens=12, ignore_eos=True) for p in PROMPTS] == expected   # alone
    assert engine.stats()["cpu_served"] > 0


@pytest.mark.parametrize("fmt,share", [("int4", 0.5), ("int8", 0.5), ("nf4", 0.5), ("int2", 0.5), ("int4", 1.0)])
def test_hybrid_policy_serves_quantized_misses_on_both_sides(tiny_quant, fmt, share):
    """The hybrid policy's CPU worker unpacks quantized experts from the pinned tier (inputs phase-
    ordered per call, as the kernel reads them) and the dispatch reads the others in place from the
    same stacks (slot S + e): the tokens of the fully resident quantized model, at a bank of one
    slot too; batched steps leave every miss to the worker."""
    full = _load(tiny_quant, experts=fmt)
    expected = full.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    for capacity in (2, 1):
        engine = _load(tiny_quant, experts=fmt, capacity=capacity, host_tier="pinned", miss_policy="hybrid",
                       cpu_misses=share, discovery=False)
        try:
            assert engine.bank.hybrid_misses.gpu_reads
            assert [engine.generate(p, max_tokens=12, ignore_eos=True) for p in PROMPTS] == expected
            assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == expected
            stats = engine.stats()
            assert stats["cpu_served"] > 0 and (stats["host_read"] > 0) == (share < 1.0)
            assert stats["host_read_bytes"] == stats["host_read"] * engine.bank.formats[0].nbytes(engine.bank.store.shape)
        finally:
            engine.close()


def test_the_default_split_starts_where_the_format_runs_best(tiny_quant):
    """--cpu-misses auto starts quantized experts at a smaller CPU share than dense ones (decoding
    4-bit codes costs the CPU more per byte); a share given by the user is kept."""
    from moestream.experts.hybrid import DEFAULT_CPU_SHARE, QUANTIZED_CPU_SHARE

    kw = dict(capacity=2, host_tier="pinned", miss_policy="hybrid", discovery=False)
    for experts, start in (("int4", QUANTIZED_CPU_SHARE), (None, DEFAULT_CPU_SHARE)):
        engine = _load(tiny_quant, experts=experts, **kw)
        try:
            assert engine.bank.hybrid_misses.cpu_share == start and engine.bank.hybrid_misses.balance.adaptive
        finally:
            engine.close()
    engine = _load(tiny_quant, experts="int4", cpu_misses=0.7, **kw)
    try:
        assert engine.bank.hybrid_misses.cpu_share == 0.7 and not engine.bank.hybrid_misses.balance.adaptive
    finally:
        engine.close()


def test_hybrid_policy_refuses_formats_its_worker_cannot_read(tiny_quant):
    with pytest.raises(InputError, match="does not compute int3"):
        _load(tiny_quant, experts="int3", capacity=2, host_tier="pinned", miss_policy="hybrid", discovery=False)


def test_hybrid_worker_takes_the_bf16_dot_path_as_the_kernel_call_does(tiny_quant):
    """In bf16 the worker hands affine 4-bit experts bf16 inputs and group sums (the kernel's bf16
    dot products), as a direct kernel call does: the hybrid policy's tokens are those of the fetch
    policy computing every miss on the CPU."""
    kw = dict(device="cpu", dtype="bfloat16", experts="int4", capacity=2, host_tier="pinned", discovery=False)
    fetch = moestream.load(tiny_quant, miss_policy="fetch", cpu_misses=1.0, **kw)
    want = [fetch.generate(p, max_tokens=12, ignore_eos=True) for p in PROMPTS]
    hybrid = moestream.load(tiny_quant, miss_policy="hybrid", cpu_misses=1.0, **kw)
    try:
        assert [hybrid.generate(p, max_tokens=12, ignore_eos=True) for p in PROMPTS] == want
        assert hybrid.stats()["cpu_served"] > 0
    finally:
        hybrid.close()
