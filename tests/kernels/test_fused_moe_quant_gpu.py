"""Dequantizing Triton kernels against their references, on the GPU (skipped without CUDA + Triton).

Fresh random inputs per case; every format and group size on both paths (T = 1 and 96), two of them at every tile size,
unrouted slots, a captured CUDA graph, and the quantized linear layer. The references dequantize
to the hidden dtype and run the plain-torch MoE; the kernels dequantize in registers and
accumulate in fp32, so outputs agree to bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from moestream import kernels
from moestream.kernels import quant_linear_reference, quant_moe_reference
from moestream.quant import parse_quant, quantize

pytestmark = pytest.mark.skipif(not kernels.fused_moe_quant_available(), reason="needs CUDA and Triton")

FORMATS = ["int8-g64", "int4-g32", "int4-g64", "int4-g128", "int3-g64", "int2-g32", "nf4-g64", "nf3-g64"]
H, I, S, K = 256, 128, 12, 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def quant_bank(spec, seed: int, hidden: int = H, inter: int = I, slots: int = S) -> dict:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list] = {}
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        for _ in range(slots):
            for name, t in quantize(torch.randn(n, k, generator=g) * 0.05, spec).parts().items():
                out.setdefault(f"{proj}.{name}", []).append(t)
    return {name: torch.stack(ts).cuda() for name, ts in out.items()}


# Every format on the decode path (T=1) and the grouped path with swept rows (T=96); two formats (one
# packed nibble, one byte) through every tile the token count selects: 4, 32, 64 (~11, 21 rows per slot), 512.
CASES = ([(name, T) for name in FORMATS for T in (1, 96)]
         + [(name, T) for name in ("int4-g32", "int8-g64") for T in (4, 32, 64, 512)])


@pytest.mark.parametrize("name,T", CASES)
def test_fused_moe_quant_matches_the_reference(name, T):
    spec = parse_quant(name)
    slots = quant_bank(spec, seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(-1, S + 1, (T, K), device="cuda", generator=g)   # -1 and S: unrouted
    weights = torch.rand(T, K, device="cuda", generator=g)
    out = kernels.fused_moe_quant(hidden, slots, ids, weights, spec)
    ref = quant_moe_reference(hidden, slots, ids, weights, spec)
    assert out.dtype == hidden.dtype and not out.isnan().any()
    assert rel(out, ref) < 1e-2, name


@pytest.mark.parametrize("path", ["decode", "grouped", "dequant"])
def test_both_paths_and_an_fp32_case(path):
    from moestream.kernels.fused_moe_quant_triton import fused_moe_quant

    spec = parse_quant("int4-g32")
    slots = quant_bank(spec, seed=7, hidden=96, inter=48)   # ragged groups: 96 = 64 + 32 at g64 below too
    hidden = torch.randn(5, 96, device="cuda")
    ids = torch.randint(0, S, (5, K), device="cuda")
    weights = torch.rand(5, K, device="cuda")
    out = fused_moe_quant(hidden, slots, ids, weights, spec, path=path)
    assert rel(out, quant_moe_reference(hidden, slots, ids, weights, spec)) < 1e-4
    ragged = parse_quant("int4-g64")
    slots = quant_bank(ragged, seed=8, hidden=96, inter=48)
    out = fused_moe_quant(hidden.bfloat16(), slots, ids, weights, ragged, path=path)
    assert rel(out, quant_moe_reference(hidden.bfloat16(), slots, ids, weights, ragged)) < 1e-2


def test_fused_moe_quant_replays_in_a_cuda_graph():
    spec = parse_quant("int4")
    slots = quant_bank(spec, seed=3)
    hidden = torch.randn(1, H, device="cuda").bfloat16()
    ids = torch.randint(0, S, (1, K), device="cuda")
    weights = torch.rand(1, K, device="cuda")
    kernels.fused_moe_quant(hidden, slots, ids, weights, spec)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe_quant(hidden, slots, ids, weights, spec)
    ids.copy_(torch.randint(0, S, (1, K), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, quant_moe_reference(hidden, slots, ids, weights, spec)) < 1e-2


@pytest.mark.parametrize("name", ["int8", "int4", "int3", "nf4"])
@pytest.mark.parametrize("T", [1, 64])
def test_quant_linear_matches_the_reference(name, T):
    spec = parse_quant(name)
    qt = quantize(torch.randn(320, 256) * 0.05, spec)
    parts = [t.cuda() if t is not None else None for t in (qt.qweight, qt.scales, qt.biases)]
    x = torch.randn(T, 256, device="cuda").bfloat16()
    bias = torch.randn(320, device="cuda").bfloat16()
    out = kernels.quant_linear(x, *parts, spec, bias)
    assert rel(out, quant_linear_reference(x, *parts, spec, bias)) < 1e-2


def test_quant_host_reads_on_the_gpu():
    """Quantized experts read in place from pinned host stacks give the bits of the same experts in slots."""
    from quant_host_checks import check_all

    check_all("cuda", (torch.float32, torch.bfloat16, torch.float16))


@pytest.mark.parametrize("name,T,path", [("int8", 512, "dequant"), ("int4", 512, "dequant"), ("int3", 512, "dequant"),
                                         ("nf4", 512, "dequant"), ("int4", 1024, "auto"), ("int8", 3072, "auto")])
def test_a_long_prompt_through_dequantized_slots(name, T, path):
    """The long prompts' path: every slot dequantized into bf16 once, then the plain grouped GEMMs
    (asked for, or taken by a call from its format's threshold on: kernels/long_prompts.py)."""
    from moestream.kernels.fused_moe_quant_triton import fused_moe_quant

    spec = parse_quant(name)
    slots = quant_bank(spec, seed=11)
    g = torch.Generator(device="cuda").manual_seed(11)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(-1, S + 1, (T, K), device="cuda", generator=g)
    weights = torch.rand(T, K, device="cuda", generator=g)
    out = fused_moe_quant(hidden, slots, ids, weights, spec, path=path)
    assert rel(out, quant_moe_reference(hidden, slots, ids, weights, spec)) < 1e-2, name



@pytest.mark.parametrize("name", ["int4-g64", "fp8"])
def test_a_long_call_dequantizes_its_slots_a_group_at_a_time_with_the_same_bits(name, monkeypatch):
    """A bank of more slots than one dequantized group (here 12 slots in groups of 5, 5 and 2) gives the
    bits of one call over every slot dequantized at once; the plan counts one group's scratch."""
    from moestream.experts.format import ExpertShape, Fp8Format
    from moestream.kernels import long_prompts
    from moestream.kernels.fused_moe_quant_triton import fused_moe_quant
    from moestream.quant.fp8 import Fp8Spec

    if name == "fp8":
        spec, g = Fp8Spec(128, 128), torch.Generator().manual_seed(5)
        fmt = Fp8Format(spec, torch.bfloat16)
        host = fmt.empty(ExpertShape(H, I), S)
        for s in range(S):
            fmt.encode(*[torch.randn(n, k, generator=g) * 0.05 for n, k in ((I, H), (I, H), (H, I))],
                       {part: t[s] for part, t in host.items()})
        slots = {part: t.cuda() for part, t in host.items()}
    else:
        spec = parse_quant(name)
        slots = quant_bank(spec, seed=5)
    g = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(1024, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(-1, S + 1, (1024, K), device="cuda", generator=g)
    weights = torch.rand(1024, K, device="cuda", generator=g)
    whole = fused_moe_quant(hidden, slots, ids, weights, spec, path="dequant")
    monkeypatch.setattr(long_prompts, "DEQUANT_GROUP_SLOTS", 5)
    assert torch.equal(fused_moe_quant(hidden, slots, ids, weights, spec, path="dequant"), whole)
    assert long_prompts.dequant_scratch_bytes(S, H, I, torch.bfloat16) == 5 * 3 * H * I * 2