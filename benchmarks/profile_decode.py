"""Where a decode step's time goes: per-kernel CUDA time of eager steps, and the graph replay time.

    python benchmarks/profile_decode.py CHECKPOINT [--steps 20] [--capacity N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = ap.parse_args()
    engine = moestream.load(args.model, device="cuda", dtype="bfloat16", capacity=args.capacity, max_context=4096)
    prompt = list(range(100, 100 + args.prompt_tokens))
    for graphs in (True, False):
        engine.generator.cuda_graphs = graphs
        engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
        engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
        print(f"cuda graphs={graphs}: {engine.last_metrics.decode_tok_s:.1f} tok/s "
              f"({1000 / max(engine.last_metrics.decode_tok_s, 1e-9):.2f} ms/token)")
    engine.generator.cuda_graphs = False
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
