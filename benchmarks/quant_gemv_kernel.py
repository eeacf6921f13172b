"""The one-row quantized GEMV (kernels/quant_gemv_triton.py) against the decode path it replaces and
the bf16 GEMV, on Qwen3-30B-A3B's dense projections.

Each shape is timed as one CUDA graph of R calls over R different weights (their bytes exceed the
50 MB L2 many times over), the way a decode step walks through its layers: every call reads its
weight from HBM. GB/s counts the bytes each call reads (packed values, scales and biases; bf16: the
weight). With --sweep, every tile of a small grid is timed and the best printed.

    python benchmarks/quant_gemv_kernel.py [--formats int4 int8] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gemv_kernel import graph_us  # noqa: E402
from moestream.kernels.gemv_triton import gemv  # noqa: E402
from moestream.kernels.quant_gemv_triton import QuantGemvTile, default_tile, quant_gemv  # noqa: E402
from moestream.kernels.quant_linear_triton import quant_gemv_path, quant_linear  # noqa: E402
from moestream.quant import parse_quant, quantize  # noqa: E402

SHAPES = {"q/k/v": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["int4"])
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles per shape")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("quant_gemv_kernel.py needs a CUDA device")
    for fmt in args.formats:
        spec = parse_quant(fmt)
        tiles = [QuantGemvTile(bn, bk, w) for bn, bk, w in
                 itertools.product((2, 4, 8, 16), (256, 512, 1024), (2, 4, 8))]
        for name, (N, K) in SHAPES.items():
            R = max(2, min(24, (400 << 20) // (N * K * 2)))
            one = quantize(torch.randn(N, K, device="cuda") * 0.02, spec)
            packed = [[t.clone() if t is not None else None for t in (one.qweight, one.scales, one.biases)]
                      for _ in range(R)]
            dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(R)]
            x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
            mb = spec.nbytes(N, K) / 1e6
            bf16 = graph_us(lambda: [gemv(x, w) for w in dense]) / R
            with quant_gemv_path(False):
                before = graph_us(lambda: [quant_linear(x.view(1, K), *p, spec) for p in packed]) / R
            tile = default_tile(N, K, spec)
            ours = timed(x, packed, spec, tile) / R
            print(f"{fmt} {name} {N}x{K} ({mb:.1f} MB, {R} weights): GEMV {ours:.2f} us ({mb / ours * 1e3:.0f} GB/s) "
                  f"{tile}; decode path {before:.2f} us ({mb / before * 1e3:.0f} GB/s); bf16 GEMV {bf16:.2f} us "
                  f"({N * K * 2 / 1e6:.1f} MB, {N * K * 2 / 1e3 / bf16:.0f} GB/s)", flush=True)
            if args.sweep:
                swept = []
                for cfg in tiles:
                    if cfg.block_k > K or cfg.block_k < spec.group or cfg.block_n * cfg.block_k > 32768:
                        continue
                    if cfg.block_n * cfg.block_k // (32 // spec.bits) < 32 * cfg.num_warps:
                        continue   # fewer words than threads
                    swept.append((timed(x, packed, spec, cfg) / R, cfg))
                for us, cfg in sorted(swept, key=lambda t: t[0])[:4]:
                    print(f"    {us:.2f} us ({mb / us * 1e3:.0f} GB/s) {cfg}", flush=True)
            packed = dense = None   # noqa: F841 (freed before the next shape's weights)
            torch.cuda.empty_cache()


def timed(x: torch.Tensor, packed: list, spec, tile: QuantGemvTile) -> float:
    """Microseconds per graph of one GEMV over each packed weight."""
    return graph_us(lambda: [quant_gemv(x, *p, spec, tile=tile) for p in packed])


if __name__ == "__main__":
    main()
