"""Checks of the fused small ops (norms, q/k norm + rotary, router top-k, the batch-1 GEMV) against the torch path.

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


def check_qk_rope_paged(device: str, dtype: torch.dtype) -> None:
    """One launch for q and k norm + rotary and the paged write of k and v: the same q as
    `norm_rope`, and the same pools as `norm_rope` of k then `paged_kv_write_reference`."""
    from moestream.kernels.paged_attention_reference import paged_kv_write_reference

    g = torch.Generator().manual_seed(6)
    B, L, bs, blocks = 3, 1, 4, 12
    for heads, kv_heads, D, R, with_norm in ((8, 2, 64, 64, True), (6, 3, 32, 16, False), (32, 4, 128, 128, True)):
        norms = [RMSNorm(D, 1e-6).to(device) for _ in range(2)]
        for n in norms:
            n.weight.data = (torch.randn(D, generator=g) * 0.3 + 1.0).to(device, dtype)
        qkv = torch.randn(B, L, (heads + 2 * kv_heads) * D, generator=g).to(device, dtype)
        q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)   # views, as the GEMM gives
        q, k, v = q.view(B, L, heads, D), k.view(B, L, kv_heads, D), v.view(B, L, kv_heads, D)
        angles = torch.rand(B, 1, L, R // 2, generator=g) * 6
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(device, dtype)
        sin = torch.cat((angles.sin(), angles.sin()), -1).to(device, dtype)
        tables = torch.randperm(blocks - 1, generator=g)[: 3 * B].view(B, 3).add(1).int().to(device)
        rows = torch.tensor([[2], [0], [1]], device=device)
        positions = torch.tensor([[5], [0], [11]], device=device)
        pools = [torch.randn(blocks, bs, kv_heads, D, generator=g).to(device, dtype) for _ in range(2)]
        want = [p.clone() for p in pools]
        scale = norms[0].fused_scale if with_norm else kernels.SCALE_NONE
        weights = (norms[0].weight, norms[1].weight) if with_norm else (None, None)
        ref_q = kernels.norm_rope(q, weights[0], 1e-6, scale, cos, sin)
        ref_k = kernels.norm_rope(k, weights[1], 1e-6, scale, cos, sin)
        paged_kv_write_reference(ref_k, v, *want, tables, rows, positions)
        out = kernels.qk_rope_paged(q, k, v, *weights, 1e-6, scale, cos, sin, *pools, tables, rows, positions)
        assert torch.equal(out, ref_q), f"q heads={heads} norm={with_norm}"
        assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1]), f"pools heads={heads}"


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


def check_uniform_router(device: str, dtype: torch.dtype) -> None:
    """Benchmark routing in one launch: k distinct ids in range per row, weighted by the router's
    softmax at them, renormalised; each call draws anew (the device counter), every expert gets
    drawn about as often as the others, and E not a power of two stays in range."""
    g = torch.Generator().manual_seed(7)
    for T, E, k in ((3, 128, 8), (2, 60, 4)):
        draws = torch.zeros(1, dtype=torch.int64, device=device)
        counts = torch.zeros(E)
        calls = 40 if E == 128 else 10
        first = None
        for i in range(calls):
            logits = torch.randn(T, E, generator=g).to(device, dtype)
            w, ids = kernels.uniform_topk(logits, k, draws, seed=1234)
            assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
            ids_c = ids.cpu()
            assert ((ids_c >= 0) & (ids_c < E)).all()
            assert all(len(set(row.tolist())) == k for row in ids_c), "ids repeat within a row"
            want = logits.float().softmax(-1).gather(-1, ids)
            _close(w, want / want.sum(-1, keepdim=True), "uniform router weights")
            counts += torch.bincount(ids_c.reshape(-1), minlength=E).float()
            first = ids_c if first is None else first
        assert int(draws.item()) == T * calls
        assert not torch.equal(first, ids_c)                  # later calls draw other experts
        if E == 128:   # 40 calls × 3 rows × 8 = 960 draws, 7.5 per expert: none missing, none far above
            assert counts.min() >= 1 and counts.max() <= 25, counts


def check_all(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    for dtype in dtypes:
        check_norms(device, dtype)
        check_norm_rope(device, dtype)
        check_qk_rope_paged(device, dtype)
        check_router(device, dtype)
        check_uniform_router(device, dtype)
        check_moe_pairs(device, dtype)
        check_gemv(device, dtype)
    check_count_mapped(device)


def check_count_mapped(device: str) -> None:
    """The count of routed ids a table maps to a slot (an expert-parallel rank's own pairs) adds to
    the counter what the torch ops count, over one block and several, for int32 and int64 ids."""
    from moestream.kernels.count_mapped_triton import count_mapped

    g = torch.Generator().manual_seed(7)
    table = torch.full((129,), -1, dtype=torch.int32)
    table[torch.randperm(128, generator=g)[:50]] = torch.arange(50, dtype=torch.int32)
    table = table.to(device)
    for T, k, dtype in ((1, 8, torch.int64), (16, 8, torch.int32), (700, 4, torch.int64)):
        ids = torch.randint(0, 128, (T, k), generator=g).to(device, dtype)
        counter = torch.tensor(5, dtype=torch.int64, device=device)
        count_mapped(ids, table, counter)
        want = 5 + int((table[ids.long()] >= 0).sum())
        assert int(counter) == want, (T, k, int(counter), want)


def check_gemv(device: str, dtype: torch.dtype) -> None:
    """The GEMV kernel on one row equals F.linear, with and without a bias, for K a multiple of
    the K step and not, and N not a multiple of the columns per program. On CUDA, `kernels.linear`
    takes it for one row and F.linear itself for more."""
    import torch.nn.functional as F

    from moestream.kernels.gemv_triton import gemv

    g = torch.Generator().manual_seed(5)
    for N, K, bias in ((130, 1024, False), (37, 300, True), (8, 64, True), (2, 2048, False)):
        w = torch.randn(N, K, generator=g).to(device, dtype)
        b = torch.randn(N, generator=g).to(device, dtype) if bias else None
        for shape in ((1, 1, K), (1, K)):
            x = torch.randn(shape, generator=g).to(device, dtype)
            out = gemv(x, w, b)
            ref = F.linear(x.float(), w.float(), b.float() if b is not None else None).to(dtype)
            _close(out, ref, f"gemv {N}x{K} bias={bias}")
            if device == "cuda":
                assert torch.equal(kernels.linear(x, w, b), out), "one row goes through the GEMV"
    x = torch.randn(3, 64, generator=g).to(device, dtype)
    w = torch.randn(16, 64, generator=g).to(device, dtype)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w)), "several rows are F.linear's"


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
