"""The FP8 e4m3 expert kernels (the dequantizing decode and grouped paths reading FP8 bytes and block
scales) on the CPU under Triton's interpreter, against `quant_moe_reference`: block grids whose
last block is ragged in rows and columns (gate_up's two grids stacked), per-channel and per-tensor scales; fp32 and fp16; -1 and out-of-range slots whose routing
weight is NaN (never multiplied), NaN-poisoned workspaces, all-unrouted giving exact zeros; and the
FP8 dense linear (`quant_linear`) against its reference."""

from __future__ import annotations

import pytest

from triton_interpreter import INTERPRETER_SKIP, run_under_interpreter

_SCRIPT = """
import contextlib
import torch
import triton
import triton.language as tl
from moestream.kernels.fused_moe_decode import fp8_hardware_conversion
from moestream.kernels.moe_tiles import _e4m3_value
from moestream.experts.format import ExpertShape, Fp8Format
from moestream.kernels import quant_linear_reference, quant_moe_reference
from moestream.kernels.dequant_slots_triton import dequantize_operand
from moestream.kernels.fused_moe_quant_triton import fused_moe_quant, quant_operand
from moestream.kernels.quant_moe_reference import dequantize_slots as ref_dequantize_slots
from moestream.kernels.quant_linear_triton import quant_linear
from moestream.quant.fp8 import Fp8Spec, quantize_fp8

_empty = torch.empty
def nan_empty(*args, **kwargs):
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7) if t.dtype != torch.uint8 else t.fill_(127)
torch.empty = nan_empty

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

@triton.jit
def _decode_all(b_ptr, out_ptr, FP8: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, _e4m3_value(tl.load(b_ptr + i), FP8))

every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
want = every.view(torch.float8_e4m3fn).float()
finite = ~want.isnan()
for mode in (1, 2):   # the hardware conversion and the bit arithmetic: every finite e4m3 value exactly
    got = _empty(256)
    _decode_all[(1,)](every, got, FP8=mode)
    assert torch.equal(got[finite], want[finite]), mode

g = torch.Generator().manual_seed(0)
H, I, S, K = HIDDEN, 40, 4, 3
conversion = contextlib.nullcontext() if NATIVE else fp8_hardware_conversion(False)
conversion.__enter__()
shape = ExpertShape(H, I)
for spec in SPECS:
    fmt = Fp8Format(spec, torch.float32)
    slots = fmt.empty(shape, S)
    for s in range(S):
        w = [torch.randn(n, k, generator=g) * 0.05 * (1 + torch.rand(n, 1, generator=g) * 4)
             for n, k in ((I, H), (I, H), (H, I))]
        fmt.encode(*w, {name: t[s] for name, t in slots.items()})
    # every slot dequantized at once (the long prompts' path) equals the reference's values exactly
    for proj, width, gated, want in zip(("gate_up", "down"), (H, I), (True, False),
                                        ref_dequantize_slots(slots, None, spec, torch.float32)):
        got = dequantize_operand(quant_operand(slots, proj, spec), width, torch.float32, gated)
        assert torch.equal(got, want), (spec.name, proj, float((got - want).abs().max()))
    for T, dtype, paths in ((1, torch.float32, ("decode",)), (3, torch.float16, ("decode", "grouped")),
                            (6, torch.float32, ("decode", "grouped", "dequant"))):
        hidden = torch.randn(T, H, generator=g).to(dtype)
        ids = torch.randint(-1, S + 1, (T, K), generator=g)
        ids[0, 0] = S                                        # out of range counts as unrouted
        weights = torch.rand(T, K, generator=g)
        weights[(ids < 0) | (ids >= S)] = float("nan")     # never multiplied
        ref = quant_moe_reference(hidden, slots, ids, torch.nan_to_num(weights), spec)
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        for path in paths:
            out = fused_moe_quant(hidden, slots, ids, weights, spec, path=path)
            assert out.dtype == dtype and not out.isnan().any(), (spec.name, T, path)
            err = rel(out, ref)
            assert err < tol, (spec.name, T, path, err)
            if T == 6:   # every path once: nothing routed gives exact zeros
                none = fused_moe_quant(hidden, slots, torch.full_like(ids, -1), weights, spec, path=path)
                assert torch.equal(none, torch.zeros_like(none)), (spec.name, T, path)
            print(f"{spec.name} T={T} {dtype} {path}: rel_err={err:.1e}")
    # a dense linear kept in FP8 (QuantLinear's kernel): the decode launch for a few rows (one row
    # included), the dequantize-then-GEMM path for prompts
    w = torch.randn(70, H, generator=g) * 0.05
    qw, qs = quantize_fp8(w, spec)
    bias = torch.randn(70, generator=g)
    for T in (1, 5, 20):
        x = torch.randn(T, H, generator=g)
        out = quant_linear(x, qw.view(torch.uint8), qs, None, spec, bias)
        err = rel(out, quant_linear_reference(x, qw.view(torch.uint8), qs, None, spec, bias))
        assert err < 1e-5, (spec.name, "linear", T, err)
print("interpreter ok")
"""


@pytest.mark.skipif(**INTERPRETER_SKIP)
@pytest.mark.parametrize("specs,native,hidden", [("[Fp8Spec(16, 32), Fp8Spec(32, 128)]", False, 128),
                                                 ("[Fp8Spec(1, None, 'weight_scale'), Fp8Spec(None, None, 'weight_scale')]",
                                                  True, 80)])
def test_fp8_kernels_under_triton_interpreter(specs, native, hidden) -> None:
    """Block grids through the portable e4m3 conversion (tiles of several whole blocks, and tiles
    inside one block), channel and tensor scales through the hardware one (ragged: one scale load per
    value); each conversion checked on all 256 bytes first. A hidden size of whole tiles (128: gate_up's
    bytes load unmasked) and a ragged one (80)."""
    result = run_under_interpreter(f"from moestream.quant.fp8 import Fp8Spec\nSPECS = {specs}\nNATIVE = {native}\n"
                                   f"HIDDEN = {hidden}\n" + _SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout
