"""The paged decode attention (kernels/paged_attention_triton.py: splits, then their merge) against torch's SDPA
over the same keys and values laid out contiguously, per call, at batch sizes and context lengths.

Each case is one CUDA graph of 200 calls, replayed 7 times; the best replay gives µs per call. With `--pools N`
the calls cycle over N copies of the KV pool (different layers' caches, as a decode step walks them); the default
sizes N so the copies exceed the GPU's L2 cache and every call reads its keys from HBM. `--pools 1` keeps one pool
(L2-resident at short contexts): what a change to the kernels' own latency shows best.

    python benchmarks/paged_decode_kernel.py [--batches 1 4] [--contexts 640 4096 16384] [--pools 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.kernels.paged_attention_triton import paged_decode_attention  # noqa: E402

CALLS, REPLAYS = 200, 7


def best_us(fn) -> float:
    """µs per call: the best replay of a graph of CALLS calls of `fn(i)`."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / CALLS * 1e3)
    return best


def case(batch: int, context: int, pools: int | None, heads: int, kv_heads: int, head_dim: int,
         block: int) -> dict:
    blocks = -(-context // block)
    pool_bytes = 2 * batch * blocks * block * kv_heads * head_dim * 2
    if pools is None:   # enough copies to exceed the L2 cache three times over
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        pools = max(1, min(64, -(-3 * l2 // pool_bytes)))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, head_dim, device="cuda", generator=g).bfloat16()
    ks = [torch.randn(batch * blocks, block, kv_heads, head_dim, device="cuda", generator=g).bfloat16() for _ in range(pools)]
    vs = [torch.randn_like(k) for k in ks]
    tables = torch.arange(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    ours = best_us(lambda i: paged_decode_attention(q, ks[i % pools], vs[i % pools], tables, lens, context))
    # the same keys and values as (batch, kv_heads, context, head_dim) for SDPA (its flash kernel, GQA)
    kc = [k.view(batch, blocks * block, kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous() for k in ks]
    vc = [v.view(batch, blocks * block, kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous() for v in vs]
    q4 = q.unsqueeze(2)
    peer = best_us(lambda i: F.scaled_dot_product_attention(q4, kc[i % pools], vc[i % pools], enable_gqa=True))
    return {"batch": batch, "context": context, "pools": pools, "ours_us": round(ours, 2), "sdpa_us": round(peer, 2),
            "ratio": round(peer / ours, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[640, 4096, 16384])
    ap.add_argument("--pools", type=int, default=None, help="KV pool copies the calls cycle over (default: past L2)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16, help="positions per KV block")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("paged_decode_kernel.py needs a CUDA GPU.")
    if args.pools is not None and args.pools < 1:
        sys.exit("--pools must be at least 1.")
    rows = []
    print(f"{'batch':>5} {'context':>8} {'pools':>5} {'ours µs':>8} {'SDPA µs':>8} {'ratio':>6}")
    for batch in args.batches:
        for context in args.contexts:
            row = case(batch, context, args.pools, args.heads, args.kv_heads, args.head_dim, args.block)
            rows.append(row)
            print(f"{batch:>5} {context:>8} {row['pools']:>5} {row['ours_us']:>8.2f} {row['sdpa_us']:>8.2f} {row['ratio']:>6.2f}")
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
