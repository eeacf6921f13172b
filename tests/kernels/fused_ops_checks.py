"""Checks of the fused small ops (norms, q/k norm + rotary, router top-k) against the torch path.

One body for both places they run: compiled on a GPU (test_fused_ops.py) and under Triton's
interpreter on the CPU (CI). The torch modules' `reference` / plain-op paths are the spec.
"""

from __future__ import annotations

import torch

from moestream import kernels
from moestream.model.norms import FP32ScaleRMSNorm, RMSNorm, ZeroCentredRMSNorm
from moestream.model.rotary import apply_rotary


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal up to the reduction order of an fp32 sum: the largest difference within about one
    rounding step of the dtype at the tensor's largest magnitude (not per element: rotary's sums can
    cancel, and a last-bit difference of an input is then large next to the tiny result)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[a.dtype]
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
    assert err <= tol, (what, err)


def check_norms(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for cls in (RMSNorm, ZeroCentredRMSNorm, FP32ScaleRMSNorm):
        for D in (96, 2048):
            norm = cls(D, 1e-6).to(device)
            norm.weight.data = (torch.randn(D, generator=g) * 0.5 + 1.0).to(device, dtype)
            x = (torch.randn(3, 5, D, generator=g) * 4).to(device, dtype)
            delta = torch.randn(3, 5, D, generator=g).to(device, dtype)
            out, summed = kernels.rms_norm(x, norm.weight, norm.eps, norm.fused_scale)
            assert summed is None
            _close(out, norm.reference(x), f"{cls.__name__} D={D}")
            out, summed = kernels.rms_norm(delta, norm.weight, norm.eps, norm.fused_scale, residual=x)
            assert torch.equal(summed, x + delta), cls.__name__
            _close(out, norm.reference(x + delta), f"{cls.__name__} add D={D}")
            strided = x[:, ::2]                                   # rows not adjacent in memory
            _close(kernels.rms_norm(strided, norm.weight, norm.eps, norm.fused_scale)[0],
                   norm.reference(strided), f"{cls.__name__} strided")


def check_norm_rope(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    B, L = 2, 3
    for heads, D, R, with_norm in ((5, 64, 64, True), (4, 128, 64, True), (3, 64, 32, False), (16, 128, 128, True)):
        norm = RMSNorm(D, 1e-6).to(device)
        norm.weight.data = (torch.randn(D, generator=g) * 0.3 + 1.0).to(device, dtype)
        wide = torch.randn(B, L, heads, 2 * D, generator=g).to(device, dtype)
        x = wide[..., :D]                                         # a strided view, as a q/gate split gives
        angles = torch.rand(B, 1, L, R // 2, generator=g) * 6
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(device, dtype)
        sin = torch.cat((angles.sin(), angles.sin()), -1).to(device, dtype)
        ref = norm.reference(x) if with_norm else x
        ref = apply_rotary(ref.transpose(1, 2), cos, sin).transpose(1, 2)
        out = kernels.norm_rope(x, norm.weight if with_norm else None, norm.eps,
                                norm.fused_scale if with_norm else kernels.SCALE_NONE, cos, sin)
        _close(out, ref.contiguous(), f"heads={heads} D={D} R={R} norm={with_norm}")


def check_router(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    for T, E, k in ((1, 128, 8), (5, 512, 10), (3, 60, 4)):
        logits = (torch.randn(T, E, generator=g) * 3).to(device, dtype)
        for mode, renorm in ((kernels.SOFTMAX_THEN_TOPK, True), (kernels.SOFTMAX_THEN_TOPK, False),
                             (kernels.TOPK_THEN_SOFTMAX, False)):
            w, ids = kernels.router_topk(logits, k, mode, renorm)
            if mode == kernels.SOFTMAX_THEN_TOPK:
                ref_w, ref_ids = torch.topk(logits.float().softmax(-1), k, dim=-1)
                if renorm:
                    ref_w = ref_w / ref_w.sum(-1, keepdim=True)
            else:
                values, ref_ids = torch.topk(logits.float(), k, dim=-1)
                ref_w = values.softmax(-1)
            assert ids.dtype == torch.int64 and w.dtype == torch.float32
            # the same experts (random logits have no ties), in descending weight order
            assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values), (T, E, k, mode)
            order = ref_ids.argsort(-1)
            _close(w.gather(-1, ids.argsort(-1)), ref_w.gather(-1, order), f"router T={T} E={E} mode={mode}")
            assert (w[:, :-1] >= w[:, 1:]).all(), "weights in descending order"
    nan = torch.full((2, 16), float("nan"), device=device, dtype=dtype)
    _, ids = kernels.router_topk(nan, 4, kernels.SOFTMAX_THEN_TOPK, True)
    assert ((ids >= 0) & (ids < 16)).all(), "NaN logits still give in-range expert ids"


def check_all(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    for dtype in dtypes:
        check_norms(device, dtype)
        check_norm_rope(device, dtype)
        check_router(device, dtype)
        check_moe_pairs(device, dtype)


def check_moe_pairs(device: str, dtype: torch.dtype) -> None:
    """fused_moe(reduce=False) rows split over two calls (disjoint slots), added, then sum_pairs:
    the same bits as one call, on both paths (what a bank streaming part of its experts relies on)."""
    g = torch.Generator().manual_seed(4)
    S, H, I, k = 6, 64, 32, 3
    gate_up = (torch.randn(S, 2 * I, H, generator=g) * 0.1).to(device, dtype)
    down = (torch.randn(S, H, I, generator=g) * 0.1).to(device, dtype)
    for T, path in ((2, "decode"), (30, "grouped")):   # T*k above 64 takes the grouped path
        hidden = torch.randn(T, H, generator=g).to(device, dtype)
        slots = torch.randint(0, S, (T, k), generator=g).to(device)
        weights = torch.rand(T, k, generator=g).to(device)
        whole = kernels.fused_moe(hidden, gate_up, down, slots, weights)
        low = torch.where(slots < 3, slots, torch.full_like(slots, -1))
        high = torch.where(slots >= 3, slots, torch.full_like(slots, -1))
        pairs = (kernels.fused_moe(hidden, gate_up, down, low, weights, reduce=False)
                 + kernels.fused_moe(hidden, gate_up, down, high, weights, reduce=False))
        assert pairs.shape == (T, k, H) and pairs.dtype == torch.float32
        assert torch.equal(kernels.sum_pairs(pairs, dtype, fused=True), whole), (T, path)
