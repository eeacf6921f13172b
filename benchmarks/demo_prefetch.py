"""Next-layer prediction accuracy and prefetch effect on the demo model (realistic routing), on any device.

    python benchmarks/demo_prefetch.py [--capacity 32] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402
from moestream.cli import DEMO_MODEL  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, nargs="+", default=[32])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    docs = [d for d in (DEMO_MODEL / "heldout_sample.txt").read_text().split("<|endoftext|>") if len(d) > 2000]
    rows = []
    for cap in args.capacity:
        for prefetch in (True, False):
            engine = moestream.load(DEMO_MODEL, device=args.device, capacity=cap, prefetch=prefetch)
            prompts = [engine.tokenizer(d, add_special_tokens=False).input_ids[:256] for d in docs[:args.prompts]]
            for p in prompts[:1]:   # warm-up: kernels, graphs
                engine.generate(p, max_tokens=8, ignore_eos=True)
            engine.reset_stats()
            tok_s = []
            for p in prompts:
                engine.generate(p, max_tokens=args.gen_tokens, ignore_eos=True)
                tok_s.append(engine.last_metrics.decode_tok_s)
            stats = engine.stats()
            row = {"capacity": cap, "prefetch": prefetch, "hit_rate": stats["hit_rate"],
                   "prediction_accuracy": stats["prediction_accuracy"], "prefetched": stats["prefetched"],
                   "decode_tok_s": sum(tok_s) / len(tok_s),
                   "per_layer_accuracy": {k: v["prediction_accuracy"] for k, v in stats["layers"].items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
