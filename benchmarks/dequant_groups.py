"""The quantized long calls' path with every slot dequantized in one group against groups of
`DEQUANT_GROUP_SLOTS` (32): time per call, peak memory above the inputs, and whether the bits agree.

Shape: Qwen3-30B-A3B's MoE layer (H=2048, I=768, 128 slots, k=8), bf16 hidden, random routing (k distinct
slots per token), `fused_moe_quant(..., path="dequant")` timed over 10 calls with CUDA events, two rounds
alternating the group sizes.

    python benchmarks/dequant_groups.py [--format int4-g64] [--tokens 4096] [--slots 128] [--groups 128 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moestream.kernels import long_prompts  # noqa: E402
from moestream.kernels.fused_moe_quant_triton import fused_moe_quant  # noqa: E402
from moestream.quant import parse_quant, quantize  # noqa: E402


def bank(spec, hidden: int, inter: int, slots: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    parts: dict[str, list[torch.Tensor]] = {}
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        for _ in range(slots):
            for name, t in quantize(torch.randn(n, k, generator=g) * 0.05, spec).parts().items():
                parts.setdefault(f"{proj}.{name}", []).append(t)
    return {name: torch.stack(ts).cuda() for name, ts in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="int4-g64")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--groups", type=int, nargs="+", default=[128, 32])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    spec = parse_quant(args.format)
    slots = bank(spec, args.hidden, args.intermediate, args.slots)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(args.slots, device="cuda")[:args.top_k] for _ in range(args.tokens)]).int()
    weights = torch.rand(args.tokens, args.top_k, device="cuda")
    first = None
    for _ in range(args.rounds):
        for group in args.groups:
            long_prompts.DEQUANT_GROUP_SLOTS = group
            out = fused_moe_quant(hidden, slots, ids, weights, spec, path="dequant")   # compiled, warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                out = fused_moe_quant(hidden, slots, ids, weights, spec, path="dequant")
            end.record()
            torch.cuda.synchronize()
            first = out if first is None else first
            print(f"{args.format} T={args.tokens} slots={args.slots} groups of {group}: "
                  f"{start.elapsed_time(end) / 10 * 1000:.0f} us a call, peak above the inputs "
                  f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB, "
                  f"same bits as the first: {torch.equal(out, first)}", flush=True)


if __name__ == "__main__":
    main()
