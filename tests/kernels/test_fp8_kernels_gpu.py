"""The FP8 e4m3 expert kernels and the FP8 linear on the GPU, against their plain-torch references
(compiled kernels, bf16; skipped without CUDA and Triton).

DeepSeek's 128 x 128 blocks at a width they do not divide (the last block ragged) and per-channel
scales, one token to a 512-token prompt (one-token, decode and grouped paths), unrouted slots, a
captured CUDA graph; the kernels dequantize in registers and accumulate in fp32, so outputs agree
with the dequantize-then-MoE reference to bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from moestream import kernels
from moestream.experts.format import ExpertShape, Fp8Format
from moestream.kernels import quant_linear_reference, quant_moe_reference
from moestream.quant.fp8 import Fp8Spec, quantize_fp8

pytestmark = pytest.mark.skipif(not kernels.fused_moe_quant_available(), reason="needs a CUDA GPU and Triton")

SPECS = [Fp8Spec(128, 128), Fp8Spec(1, None, "weight_scale")]
H, I, S, K = 640, 320, 12, 8   # 640 = 5 x 128, 320 = 2.5 x 128: a ragged last block


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def fp8_bank(spec: Fp8Spec, seed: int) -> dict:
    fmt, g = Fp8Format(spec, torch.bfloat16), torch.Generator().manual_seed(seed)
    slots = fmt.empty(ExpertShape(H, I), S)
    for s in range(S):
        w = [torch.randn(n, k, generator=g) * 0.05 for n, k in ((I, H), (I, H), (H, I))]
        fmt.encode(*w, {name: t[s] for name, t in slots.items()})
    return {name: t.cuda() for name, t in slots.items()}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("T", [1, 4, 32, 512])
def test_fp8_moe_matches_the_reference(spec, T):
    slots = fp8_bank(spec, seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(-1, S + 1, (T, K), device="cuda", generator=g)   # -1 and S: unrouted
    weights = torch.rand(T, K, device="cuda", generator=g)
    out = kernels.fused_moe_quant(hidden, slots, ids, weights, spec)
    ref = quant_moe_reference(hidden, slots, ids, weights, spec)
    assert out.dtype == hidden.dtype and not out.isnan().any()
    assert rel(out, ref) < 1e-2, (spec.name, T)
    if T >= 32:   # the long prompts' path: every slot dequantized into bf16 once, then the plain GEMMs
        from moestream.kernels.fused_moe_quant_triton import fused_moe_quant

        assert rel(fused_moe_quant(hidden, slots, ids, weights, spec, path="dequant"), ref) < 1e-2, (spec.name, T)


def test_fp8_decode_replays_in_a_cuda_graph():
    spec = SPECS[0]
    slots = fp8_bank(spec, seed=3)
    hidden = torch.randn(1, H, device="cuda").bfloat16()
    ids = torch.randint(0, S, (1, K), device="cuda")
    weights = torch.rand(1, K, device="cuda")
    eager = kernels.fused_moe_quant(hidden, slots, ids, weights, spec)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.fused_moe_quant(hidden, slots, ids, weights, spec)
    ids.copy_(torch.randint(0, S, (1, K), device="cuda"))
    graph.replay()
    assert rel(captured, quant_moe_reference(hidden, slots, ids, weights, spec)) < 1e-2
    assert eager.shape == captured.shape


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("T", [1, 8, 64])
def test_fp8_linear_matches_the_reference(spec, T):
    q, scale = quantize_fp8(torch.randn(384, H) * 0.05, spec)
    q, scale = q.view(torch.uint8).cuda(), scale.cuda()
    bias = torch.randn(384, device="cuda").bfloat16()
    x = torch.randn(T, H, device="cuda").bfloat16()
    out = kernels.quant_linear(x, q, scale, None, spec, bias)
    assert rel(out, quant_linear_reference(x, q, scale, None, spec, bias)) < 1e-2
