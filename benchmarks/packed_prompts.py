"""Prompts admitted together: one packed forward against one forward per prompt, alternated in one process.

`--streams` prompts of `--prompt-tokens` random tokens are added to the engine at once and stepped
until every one has its first token, with the step's prompt chunks run as one forward (`pack_prompts`,
the default: the next prompt cut to fill each step's `--prefill-chunk`), as one forward but each prompt
whole where it fits a chunk ("packed, whole": steps left part empty), and one forward each. Reported per mode: the time until every prompt has its first token
(the last stream's TTFT), the expert bytes the bank copied, the forwards run. The routing is stated:
the model's own, uniform (the worst case for a bank) or a replayed trace.

    python benchmarks/packed_prompts.py --ckpt /tmp/q3 --out /tmp/packed --capacity 32 --routing uniform
    python benchmarks/packed_prompts.py --ckpt moestream/demo_model --out /tmp/packed --device cpu --capacity 8
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_args, log, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.bench.routing import apply_routing  # noqa: E402
from moestream.runtime.sampling import SamplingParams  # noqa: E402


def first_tokens(engine, prompts: list[list[int]]) -> float:
    """Seconds until every prompt has its first token (the engine idle before and after)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True)) for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    sync()
    return time.perf_counter() - t0


def run(args) -> dict:
    engine = moestream.load(str(args.ckpt), device=args.device, dtype=args.dtype, capacity=args.capacity,
                            gpu_memory=args.gpu_memory, max_batch=max(args.streams, 1), kv_rows=max(args.streams, 1),
                            prefill_chunk=args.prefill_chunk)
    routing = apply_routing(engine, args.routing, args.trace)
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    modes = {"packed": (True, True), "packed, whole": (True, False), "one each": (False, False)}
    rows: dict[str, dict[str, list]] = {m: {"seconds": [], "bytes_copied": [], "forwards": []} for m in modes}
    for rnd in range(args.rounds + 1):   # round 0 warms up (kernels compiled for these shapes), unrecorded
        for mode, (pack, fill) in modes.items():
            prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
            engine.pack_prompts = pack and engine.runner.packs_prompts
            engine.fill_steps = fill   # "packed, whole": no prompt cut to fill a step
            engine.reset_stats()
            seconds = first_tokens(engine, prompts)
            if rnd:
                rows[mode]["seconds"].append(seconds)
                rows[mode]["bytes_copied"].append(engine.stats().get("bytes_copied", 0))
                rows[mode]["forwards"].append(engine.counters.prefill_forwards)
    summary = {mode: {"all_first_tokens_s": statistics.median(r["seconds"]),
                      "gb_copied": statistics.median(r["bytes_copied"]) / 1e9,
                      "forwards": statistics.median(r["forwards"]), "raw": r} for mode, r in rows.items()}
    packed, each = summary["packed"], summary["one each"]
    return {"streams": args.streams, "prompt_tokens": args.prompt_tokens, "capacity": args.capacity,
            "routing": routing.label if routing is not None else "the model's own",
            "device": str(engine.device), "dtype": str(engine.dtype), "host_cores": os.cpu_count(),
            "prefill_chunk": engine.runner.prefill_chunk, "modes": summary,
            "speedup": each["all_first_tokens_s"] / packed["all_first_tokens_s"] if packed["all_first_tokens_s"] else None,
            "fill_speedup": (summary["packed, whole"]["all_first_tokens_s"] / packed["all_first_tokens_s"]
                             if packed["all_first_tokens_s"] else None)}


def main() -> int:
    ap = engine_args(__doc__, streams=16, routing="uniform")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", default="auto", help="a step's prompt tokens (every prompt must fit in one step)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.prefill_chunk != "auto":
        args.prefill_chunk = int(args.prefill_chunk)
    result = run(args)
    for mode, r in result["modes"].items():
        log(f"{mode:>13}: every first token in {1000 * r['all_first_tokens_s']:.1f} ms, "
            f"{r['gb_copied']:.3f} GB of experts copied, {r['forwards']:g} forwards")
    log(f"{result['streams']} prompts of {result['prompt_tokens']} tokens, routing {result['routing']}: "
        f"packed {result['speedup']:.2f}x one forward each, {result['fill_speedup']:.2f}x packed steps of whole prompts")
    write_result(args.out, "packed_prompts", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
