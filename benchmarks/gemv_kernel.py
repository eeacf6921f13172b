"""The batch-1 GEMV (kernels/gemv_triton.py) against cuBLAS's F.linear, on Qwen3-30B-A3B's projections.

Each shape is timed as one CUDA graph of R GEMVs over R different weights (R chosen so their bytes
exceed the 50 MB L2 many times over), the way a decode step walks through its layers: every call
reads its weight from HBM. With --sweep, every tile of a small grid is timed and the best printed.

    python benchmarks/gemv_kernel.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.kernels.gemv_triton import GemvConfig, default_config, gemv  # noqa: E402

SHAPES = {"q/k/v": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048),
          "qwen2-moe shared gate/up": (11264, 2048)}


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per replay of one graph of `fn`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles per shape")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_kernel.py needs a CUDA device")
    tiles = [GemvConfig(bn, bk, w, st) for bn, bk, w, st in
             itertools.product((4, 8, 16, 32), (128, 256, 512), (4, 8), (1, 3))]
    for name, (N, K) in SHAPES.items():
        R = max(2, min(24, (400 << 20) // (N * K * 2)))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(R)]
        x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
        mb = N * K * 2 / 1e6
        cublas = graph_us(lambda: [F.linear(x, w) for w in weights]) / R
        default = default_config(N, K)
        ours = graph_us(lambda: [gemv(x, w, config=default) for w in weights]) / R
        print(f"{name} {N}x{K} ({mb:.1f} MB, {R} weights): cuBLAS {cublas:.2f} us ({mb / cublas:.2f} TB/s), "
              f"GEMV {ours:.2f} us ({mb / ours:.2f} TB/s) {default}", flush=True)
        if args.sweep:
            timed = []
            for cfg in tiles:
                if cfg.block_n * cfg.block_k > 16384 or cfg.block_n * cfg.block_k < 32 * cfg.num_warps * 4:
                    continue
                timed.append((graph_us(lambda c=cfg: [gemv(x, w, config=c) for w in weights]) / R, cfg))
            for us, cfg in sorted(timed, key=lambda t: t[0])[:4]:
                print(f"    {us:.2f} us ({mb / us:.2f} TB/s) {cfg}")


if __name__ == "__main__":
    main()
