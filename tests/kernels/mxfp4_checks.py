"""Checks of the MXFP4 MoE kernels against the plain-torch reference, shared by the interpreter test
(CPU) and the GPU test: both paths (one pair per program; grouped by slot into M-blocks of 16 with
padding rows), random MXFP4 slots with biases, GPT-OSS's clamped SwiGLU and plain SwiGLU,
-1 and out-of-range slots whose routing weight is NaN (a kernel that
reads it fails), and the pair rows of `reduce=False` summing to the reduced call."""

from __future__ import annotations

import torch

from moestream.kernels.moe_reference import Activation
from moestream.kernels.mxfp4_moe import fused_mxfp4_moe, mxfp4_moe_reference
from moestream.quant.mxfp4 import quantize_mxfp4


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def mxfp4_bank(S: int, H: int, I: int, dtype, device, g, bias: bool = True) -> dict:
    out = {}
    for proj, (n, k) in (("gate_up", (2 * I, H)), ("down", (H, I))):
        blocks, scales = quantize_mxfp4(torch.randn(S, n, k, generator=g) * 0.1)
        out[f"{proj}.blocks"] = blocks.reshape(S, n, k // 2).to(device)
        out[f"{proj}.scales"] = scales.to(device)
    if bias:
        out["gate_up_bias"] = (torch.randn(S, 2 * I, generator=g) * 0.1).to(device, dtype)
        out["down_bias"] = (torch.randn(S, H, generator=g) * 0.1).to(device, dtype)
    return out


def check_all(device: str, dtypes=(torch.float32,)) -> None:
    from moestream.kernels.fused_moe_mxfp4_triton import mxfp4_grouped, mxfp4_pairs
    from moestream import kernels

    g = torch.Generator().manual_seed(0)
    S, H, I, k = 5, 96, 64, 2   # H: three 32-value groups, so the 64-wide K steps end on half a step
    for dtype in dtypes:
        first = dtype == dtypes[0]   # the first dtype takes every case, the others the clamped SwiGLU at two sizes
        for act, bias in ((Activation("swiglu_clamped", 1.3, 0.4), True), (Activation(), False))[:2 if first else 1]:
            slots = mxfp4_bank(S, H, I, dtype, device, g, bias)
            cases = ((1, mxfp4_pairs), (3, mxfp4_pairs), (3, mxfp4_grouped), (20, mxfp4_grouped))
            for T, run in cases if first else cases[1:3]:
                hidden = torch.randn(T, H, generator=g).to(device, dtype)
                ids = torch.randint(0, S, (T, k), generator=g).to(device)
                weights = torch.rand(T, k, generator=g).to(device)
                if T > 1:
                    ids[1, 0], ids[2, 1] = -1, S + 4
                    weights[1, 0] = weights[2, 1] = float("nan")
                want = mxfp4_moe_reference(hidden, slots, ids, weights, act, reduce=False)
                pairs = run(hidden, slots, ids, weights, act)
                assert pairs.shape == (T, k, H) and not pairs.isnan().any()
                assert rel(pairs, want) < (1e-5 if dtype == torch.float32 else 2e-2), (dtype, act, T, rel(pairs, want))
                if T > 1:
                    assert torch.equal(pairs[1, 0], torch.zeros(H, device=device))
                    assert torch.equal(pairs[2, 1], torch.zeros(H, device=device))
                summed = kernels.sum_pairs(pairs, dtype, fused=True)
                ref = mxfp4_moe_reference(hidden, slots, ids, weights, act)
                assert rel(summed, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
                if run is mxfp4_grouped:   # the dispatch's entry takes this path at this T (> 16 tokens)
                    whole = fused_mxfp4_moe(hidden, slots, ids, weights, act)
                    assert T <= 16 or torch.equal(whole, summed)
