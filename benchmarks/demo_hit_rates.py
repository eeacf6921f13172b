"""Bank hit rates of the demo model across capacities: realistic (trained) routing, 8 of 128 experts.

    python benchmarks/demo_hit_rates.py [--capacities 8 16 32 64 128] [--json out.json]

Prompts are the first tokens of held-out files from the demo model's held-out sample; each run
decodes greedily. Hit rate depends on routing, not on the device, so this runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402
from moestream.cli import DEMO_MODEL  # noqa: E402


def prompts_from_sample(tokenizer, n: int, length: int) -> list[list[int]]:
    docs = (DEMO_MODEL / "heldout_sample.txt").read_text().split("<|endoftext|>")
    docs = [d for d in docs if len(d) > 4 * length][:n]
    return [tokenizer(d, add_special_tokens=False).input_ids[:length] for d in docs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacities", type=int, nargs="+", default=[8, 16, 19, 32, 64, 128])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for residency in ("lcp", "lru"):
        for cap in args.capacities:
            engine = moestream.load(DEMO_MODEL, device="cpu", dtype="float32", capacity=cap, residency=residency)
            prompts = prompts_from_sample(engine.tokenizer, args.prompts, args.prompt_tokens)
            decode_hits = decode_pairs = 0
            t0 = time.perf_counter()
            for p in prompts:
                for i, _ in enumerate(engine.stream_tokens(p, max_tokens=args.gen_tokens, ignore_eos=True)):
                    if i == 0:   # the prompt is done: count decode steps only from here
                        engine.bank.sync_stats()
                        first = engine.bank.stats.total()
                engine.bank.sync_stats()
                last = engine.bank.stats.total()
                decode_hits += last.hits - first.hits
                decode_pairs += (last.hits + last.misses) - (first.hits + first.misses)
            row = {"residency": residency, "capacity": cap, "fraction": cap / 128,
                   "decode_hit_rate": decode_hits / decode_pairs, "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
