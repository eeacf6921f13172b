"""Prompts at a bank with a share of each streamed chunk's missing experts computed on the CPU
(`--prompt-cpu-misses`), against none, alternated on one loaded engine.

At a bank a prompt chunk's layer streams every expert it misses through the staging buffers, and the
PCIe link bounds it; the CPU can compute some of those experts from host RAM meanwhile. For each
`--prompt-tokens` length and each `--shares` value (0: none, a share, or auto: by the costs the
fetch policy measures), fresh prompts of random tokens are timed to their first token, in rounds
(every share once per round, after one unrecorded round), and the median is reported with the
share of the missing pairs the CPU took and the GB copied. The routing is stated: uniform (the
default, the worst case for a bank), the model's own, or a replayed trace.

    python benchmarks/prompt_cpu_share.py --ckpt /tmp/q3.gguf --out /tmp/pcs --capacity 32 \\
        [--prompt-tokens 512 4096 16384] [--shares 0 auto 0.25 0.5] [--rounds 2]
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_args, log, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.bench.routing import apply_routing  # noqa: E402
from moestream.cli.flags import share_or_auto  # noqa: E402


def run(args) -> dict:
    longest = max(args.prompt_tokens)
    engine = moestream.load(str(args.ckpt), device=args.device, dtype=args.dtype, capacity=args.capacity,
                            gpu_memory=args.gpu_memory, max_context=longest + 16, prompt_cpu_misses="auto",
                            host_tier="pinned")
    fetcher = engine.bank.fetcher
    if fetcher is None:
        raise SystemExit("every expert is resident at this capacity: no prompt streams anything; give --capacity")
    routing = apply_routing(engine, args.routing, args.trace)
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    rows = {(n, str(s)): {"seconds": [], "cpu_share": [], "gb_copied": []}
            for n in args.prompt_tokens for s in args.shares}
    for rnd in range(args.rounds + 1):   # round 0 unrecorded: kernels compiled, costs measured
        for n in args.prompt_tokens:
            for share in args.shares:
                fetcher.prompt_cpu_share = share
                engine.reset_stats()
                engine.generate([rng.randrange(1, vocab) for _ in range(n)], max_tokens=1, ignore_eos=True)
                stats = engine.stats()
                if rnd:
                    row = rows[(n, str(share))]
                    row["seconds"].append(engine.last_metrics.ttft_s)
                    row["cpu_share"].append(stats.get("cpu_served", 0) / max(1, stats.get("misses", 0)))
                    row["gb_copied"].append(stats.get("bytes_copied", 0) / 1e9)
                    log(f"round {rnd}: {n} tokens, CPU share {share}: {1000 * row['seconds'][-1]:.1f} ms, "
                        f"the CPU took {row['cpu_share'][-1]:.0%} of the missed pairs")   # a run cut short keeps these
    table = []
    for (n, share), r in rows.items():
        seconds = statistics.median(r["seconds"])
        table.append({"prompt_tokens": n, "share": share, "prompt_tok_s": n / seconds, "ttft_ms": 1000 * seconds,
                      "cpu_share_of_misses": statistics.median(r["cpu_share"]),
                      "gb_copied": statistics.median(r["gb_copied"]), "raw": r})
    return {"capacity": engine.bank.capacity, "miss_policy": engine.bank.miss_policy,
            "routing": routing.label if routing is not None else "the model's own", "device": str(engine.device),
            "dtype": str(engine.dtype), "prefill_chunk": engine.runner.prefill_chunk,
            "costs": fetcher.costs.describe() if fetcher.costs is not None else None, "rows": table}


def main() -> int:
    ap = engine_args(__doc__, streams=1, routing="uniform")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--shares", type=share_or_auto, nargs="+", default=[0.0, "auto", 0.25, 0.5])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    result = run(args)
    for r in result["rows"]:
        log(f"{r['prompt_tokens']:>6} tokens, CPU share {r['share']:>5}: {r['prompt_tok_s']:,.0f} tok/s "
            f"({r['ttft_ms']:.1f} ms), the CPU took {r['cpu_share_of_misses']:.0%} of the missed pairs, "
            f"{r['gb_copied']:.2f} GB copied")
    log(f"capacity {result['capacity']}, {result['miss_policy']} policy, routing {result['routing']}, "
        f"chunk {result['prefill_chunk']}, {result['device']}; {result['costs']}")
    write_result(args.out, "prompt_cpu_share", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
