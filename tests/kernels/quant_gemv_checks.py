"""Checks of the one-row quantized GEMV (quant_gemv_triton.py) against the reference linear layer and
the decode path; one body for the GPU test (compiled) and the CPU test (Triton's interpreter)."""

from __future__ import annotations

import torch

from moestream.kernels.quant_gemv_triton import QuantGemvTile, quant_gemv, quant_gemv_supported
from moestream.kernels.quant_linear_reference import quant_linear_reference
from moestream.kernels.quant_linear_triton import quant_gemv_path, quant_linear
from moestream.quant import parse_quant, quantize

# (format, N, K): N never a multiple of the tile; K whole K steps, or a partial last one (192)
CASES = (("int4-g64", 70, 128), ("int4-g32", 37, 192), ("int8-g32", 45, 192), ("int2-g32", 21, 128),
         ("nf4-g64", 33, 192), ("int4-g128", 19, 256))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check_quant_gemv(device: str, dtype: torch.dtype, fmt: str, N: int, K: int) -> None:
    spec = parse_quant(fmt)
    assert quant_gemv_supported(spec, K)
    g = torch.Generator().manual_seed(N * K)
    qt = quantize(torch.randn(N, K, generator=g) * 0.05, spec)
    parts = [t.to(device) if t is not None else None for t in (qt.qweight, qt.scales, qt.biases)]
    bias = torch.randn(N, generator=g).to(device, dtype)
    x = torch.randn(1, 1, K, generator=g).to(device, dtype)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
    ref = quant_linear_reference(x.view(1, K), *parts, spec, bias).view(1, 1, N)
    for tile in (None, QuantGemvTile(block_n=8, block_k=128, num_warps=2), QuantGemvTile(2, 64, 4)):
        if tile is not None and tile.block_k < spec.group:
            continue
        out = quant_gemv(x, *parts, spec, bias, tile=tile)
        assert out.shape == (1, 1, N) and out.dtype == dtype and not out.isnan().any(), (fmt, tile)
        assert _rel(out, ref) < tol, (fmt, tile, _rel(out, ref))
    plain = quant_gemv(x, *parts, spec)
    assert _rel(plain, quant_linear_reference(x.view(1, K), *parts, spec).view(1, 1, N)) < tol, "without a bias"
    # quant_linear takes the GEMV for one row, the decode path with it switched off: both the reference
    picked = quant_linear(x.view(1, K), *parts, spec, bias)
    assert torch.equal(picked, quant_gemv(x.view(1, K), *parts, spec, bias)), "one row takes the GEMV"
    with quant_gemv_path(False):
        other = quant_linear(x.view(1, K), *parts, spec, bias)
    assert _rel(other, ref.view(1, N)) < tol, fmt


def check_all(device: str, dtypes: tuple[torch.dtype, ...], cases=CASES) -> None:
    for fmt, N, K in cases:
        for dtype in dtypes:
            check_quant_gemv(device, dtype, fmt, N, K)
