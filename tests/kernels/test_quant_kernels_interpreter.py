"""The dequantizing Triton kernels on the CPU, under Triton's interpreter (CI's check of them).

Every format (8/4/3/2-bit affine, NF4, NF3; 4-bit with fp32 and fp16 scales and biases too) through both MoE paths (decode: GEMV at one pair
per slot, dot for several; grouped: align + grouped GEMM) and the long calls' dequantized path (in one group
of slots and in several, which give the same bits) and the quantized linear layer, in fp32
and fp16 (the interpreter's bf16 `tl.dot` is broken), against the plain-torch references. The
shapes are small but odd: a ragged last group (96 = 64 + 32 at g64), N not a multiple of the
tile, -1 and out-of-range slots whose routing weight is NaN (so a kernel that multiplies an
unrouted pair fails), NaN-poisoned workspaces, and all-unrouted giving exact zeros.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from triton_interpreter import INTERPRETER_SKIP, run_under_interpreter

_SCRIPT = """
import torch
from moestream.kernels import long_prompts, quant_linear_reference, quant_moe_reference
from moestream.kernels.dequant_slots_triton import dequantize_operand
from moestream.kernels.fused_moe_quant_triton import fused_moe_quant, quant_operand
from moestream.kernels.quant_moe_reference import dequantize_slots as ref_dequantize_slots
from moestream.kernels.quant_linear_triton import quant_linear
from moestream.quant import parse_quant, quantize

_empty = torch.empty
def nan_empty(*args, **kwargs):
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)
torch.empty = nan_empty

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

def bank(spec, H, I, S, g):
    out = {}
    for proj, (n, k) in (("gate_up", (2 * I, H)), ("down", (H, I))):
        for _ in range(S):
            for name, t in quantize(torch.randn(n, k, generator=g) * 0.05, spec).parts().items():
                out.setdefault(f"{proj}.{name}", []).append(t)
    return {k: torch.stack(v) for k, v in out.items()}

g = torch.Generator().manual_seed(0)
H, I = SHAPE
S, K = 5, 3
for name in FORMATS:
    base, _, scales = name.partition(":")
    spec = parse_quant(base, {"": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[scales])
    slots = bank(spec, H, I, S, g)
    # every slot dequantized at once (the long prompts' path) equals the reference's values exactly
    for proj, width, gated, want in zip(("gate_up", "down"), (H, I), (True, False),
                                        ref_dequantize_slots(slots, None, spec, torch.float32)):
        got = dequantize_operand(quant_operand(slots, proj, spec), width, torch.float32, gated)
        assert torch.equal(got, want), (name, proj, float((got - want).abs().max()))
    for T, dtype in ((1, torch.float32), (3, torch.float16), (6, torch.float32)):
        hidden = torch.randn(T, H, generator=g).to(dtype)
        ids = torch.randint(-1, S + 1, (T, K), generator=g)
        ids[0, 0] = S                                        # out of range counts as unrouted
        weights = torch.rand(T, K, generator=g)
        weights[(ids < 0) | (ids >= S)] = float("nan")     # never multiplied
        ref = quant_moe_reference(hidden, slots, ids, torch.nan_to_num(weights), spec)
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        for path in ("decode", "grouped", "dequant") if T == 6 else ("decode", "grouped"):
            out = fused_moe_quant(hidden, slots, ids, weights, spec, path=path)
            assert out.dtype == dtype and not out.isnan().any(), (name, T, path)
            err = rel(out, ref)
            assert err < tol, (name, T, path, err)
            if T == 6:   # every path once: nothing routed gives exact zeros
                none = fused_moe_quant(hidden, slots, torch.full_like(ids, -1), weights, spec, path=path)
                assert torch.equal(none, torch.zeros_like(none)), (name, T, path)
            print(f"{name} T={T} {dtype} {path}: rel_err={err:.1e}")
            if path == "dequant":   # the 5 slots dequantized 2, 2 and 1 at a time: the bits of one group
                long_prompts.DEQUANT_GROUP_SLOTS = 2
                grouped = fused_moe_quant(hidden, slots, ids, weights, spec, path=path)
                long_prompts.DEQUANT_GROUP_SLOTS = 32
                assert torch.equal(grouped, out), (name, "groups of 2", float((grouped - out).abs().max()))
    qt = quantize(torch.randn(80, H, generator=g) * 0.05, spec)
    bias = torch.randn(80, generator=g)
    for T in (1, 5, 40):
        x = torch.randn(T, H, generator=g)
        out = quant_linear(x, qt.qweight, qt.scales, qt.biases, spec, bias)
        err = rel(out, quant_linear_reference(x, qt.qweight, qt.scales, qt.biases, spec, bias))
        assert err < 1e-5, (name, "linear", T, err)
print("interpreter ok")
"""


@pytest.mark.skipif(**INTERPRETER_SKIP)
@pytest.mark.parametrize("formats,shape", [(["int8-g32", "int4-g64", "nf4-g32"], (96, 48)),
                                           (["int3-g32", "int2-g32", "nf3-g64"], (96, 48)),
                                           # fp32 scales and biases (GPTQ/AWQ repacked), fp16 (GGUF's Q4_0)
                                           (["int4-g32:fp32", "int4-g32:fp16"], (256, 64))])
def test_quant_kernels_under_triton_interpreter(formats, shape) -> None:
    """(H, I): ragged (96 = 64 + 32 at g64, tiles masked along K) or whole tiles (256, 64: every K-tile of
    the grouped path and of the decode path loads its bytes and A's columns unmasked)."""
    result = run_under_interpreter(f"FORMATS = {formats!r}\nSHAPE = {shape!r}\n" + _SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_quant_host_reads_under_triton_interpreter() -> None:
    """Every format in fp32 (the interpreter is slow; the GPU test takes them all, in every dtype)."""
    checks = Path(__file__).with_name("quant_host_checks.py")
    result = run_under_interpreter(f"""
        import sys, torch
        sys.path.insert(0, {str(checks.parent)!r})
        from {checks.stem} import FORMATS, check_quant_host_reads, check_split_slots
        check_split_slots("cpu")
        for fmt in FORMATS:
            if not fmt.startswith("fp8"):   # its own test below, which runs beside this one
                check_quant_host_reads("cpu", torch.float32, fmt)
        print("interpreter ok")
    """)
    assert result.returncode == 0 and "interpreter ok" in result.stdout, result.stderr[-4000:]


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_fp8_host_reads_under_triton_interpreter() -> None:
    """FP8 experts (ragged blocks) read in place from host stacks by the decode launches, as the
    hybrid policy's device side reads its share of FP8 misses."""
    checks = Path(__file__).with_name("quant_host_checks.py")
    result = run_under_interpreter(f"""
        import sys, torch
        sys.path.insert(0, {str(checks.parent)!r})
        from {checks.stem} import check_quant_host_reads
        check_quant_host_reads("cpu", torch.float32, "fp8-b12x12")
        print("interpreter ok")
    """)
    assert result.returncode == 0 and "interpreter ok" in result.stdout, result.stderr[-4000:]
