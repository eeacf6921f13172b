"""Where a prefill's time goes: a cold prompt (pp) and an agent's cached second turn, timed, then
the second turn (or, `--profile cold`, a cold prompt) under the torch profiler (per-kernel CUDA time
and host time).

The second turn is a `--prefix-tokens` prompt answered once (its KV kept by the prefix cache),
then the same prompt plus `--new-tokens` new ones: only those are prefilled, attending to the
whole prefix. Times are the engine's time to first token (median of `--repeats`, fresh prompts
each time so the cold prompt never hits the cache), after one unmeasured round of each shape.

Routing (`--routing`, default uniform, as the other benchmarks) matters here: a random-weight
model's own routing sends every token of a prompt to nearly the same experts, so its prefill reads a
few experts per layer instead of all of them.

With `--capacity N` the bank holds N experts per layer and the rest sit in pinned host memory (the
hybrid miss policy: a prompt streams its missing experts through the staging buffers); the profile
then shows how long the host-to-device copies took against the prefill's own time. `--prefix-tokens
0` skips the second turn. `--ab` alternates the staged copies' two switches in one process: the next
layer's first groups copied ahead (`copy_ahead`) and runs of consecutive experts copied at once
(`staged_copy_runs`), each off and both off against both on, rotating the order every round.

    python benchmarks/prefill_profile.py CHECKPOINT [--prompt-tokens 512] [--prefix-tokens 8192]
        [--new-tokens 200] [--kv-layout auto|paged|rows] [--routing uniform|model|trace] [--no-profile]
        [--profile second|cold] [--capacity N] [--ab] [--ab-rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402
from moestream.bench import apply_routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-layout", choices=["auto", "paged", "rows"], default="auto")
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default="uniform")
    ap.add_argument("--trace", type=Path, default=Path("benchmarks/traces/demo_heldout_trace.json"))
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile", choices=["second", "cold"], default="second",
                    help="which prefill the profiler records: the cached second turn, or a cold prompt")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test on a tiny checkpoint")
    ap.add_argument("--capacity", type=int, default=None,
                    help="experts per layer on the device; the rest in pinned host memory (hybrid miss policy)")
    ap.add_argument("--ab", action="store_true",
                    help="with --capacity: cold prompts with the staged copies' switches on and off, alternated")
    ap.add_argument("--ab-rounds", type=int, default=3)
    args = ap.parse_args()
    bounded = dict(capacity=args.capacity, host_tier="pinned", miss_policy="hybrid") if args.capacity else {}
    engine = moestream.load(args.model, device=args.device, dtype="bfloat16", kv_layout=args.kv_layout,
                            max_context=max(args.prefix_tokens + args.new_tokens, args.prompt_tokens) + 64,
                            prefix_cache_memory="2GiB", **bounded)
    apply_routing(engine, args.routing, args.trace)
    rng = random.Random(0)
    vocab = engine.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    def ttft(prompt: list[int]) -> float:
        engine.generate(prompt, max_tokens=1, ignore_eos=True)
        return engine.last_metrics.ttft_s

    def cold() -> float:
        return ttft(tokens(args.prompt_tokens))

    def second_turn() -> tuple[float, int]:
        prefix = tokens(args.prefix_tokens)
        ttft(prefix)
        seq_cached = engine.prefix_cache_stats()["reused_tokens"]
        t = ttft(prefix + tokens(args.new_tokens))
        return t, engine.prefix_cache_stats()["reused_tokens"] - seq_cached

    layout = "paged" if engine.plan.memory.paged else "rows"
    turns_too = args.prefix_tokens > 0
    cold()
    if turns_too:
        second_turn()
    pp = statistics.median(cold() for _ in range(args.repeats))
    print(f"routing {args.routing}, kv {layout}: cold {args.prompt_tokens}-token prompt {1000 * pp:.1f} ms "
          f"({args.prompt_tokens / pp:,.0f} tok/s)")
    if turns_too:
        turns = [second_turn() for _ in range(args.repeats)]
        print(f"routing {args.routing}, kv {layout}: second turn ({args.prefix_tokens} cached + {args.new_tokens} "
              f"new) {1000 * statistics.median(t for t, _ in turns):.1f} ms, reused {turns[-1][1]} tokens")
    if args.ab:
        staged_ab(cold, args.repeats, args.ab_rounds)
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    if args.profile == "cold" or not turns_too:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiled = cold()
        print(f"profiled cold prompt: {1000 * profiled:.1f} ms")
    else:
        prefix = tokens(args.prefix_tokens)
        ttft(prefix)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ttft(prefix + tokens(args.new_tokens))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    if args.capacity:
        copy_summary(prof)


def copy_summary(prof) -> None:
    """The profiled prompt's copies from pinned host memory (the experts, and each layer's small stage
    maps): how many, how long the link copied and at what rate, and how long it sat idle between them."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    copies = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"
                     and "Pinned -> Device" in e["name"]), key=lambda e: e["ts"])
    if not copies:
        print("no copies from pinned memory in the profiled prompt")
        return
    busy = sum(e["dur"] for e in copies)
    nbytes = sum(e.get("args", {}).get("bytes", 0) for e in copies)
    gaps = [b["ts"] - a["ts"] - a["dur"] for a, b in zip(copies, copies[1:])]
    long_gaps = [g for g in gaps if g >= 1000]
    print(f"pinned copies: {len(copies)}, {nbytes / 1e9:.2f} GB, link busy {busy / 1e3:.1f} ms at "
          f"{nbytes / busy / 1e3:.1f} GB/s; idle between copies {sum(gaps) / 1e3:.1f} ms "
          f"({len(long_gaps)} gaps of 1 ms or more: {sum(long_gaps) / 1e3:.1f} ms)")


def staged_ab(cold, repeats: int, rounds: int) -> None:
    """Median cold-prompt time of each setting of the staged copies' switches, rotated each round."""
    import contextlib

    from moestream.experts import fetch

    settings = {"both on": (True, True), "copy ahead off": (False, True), "copy runs off": (True, False),
                "both off": (False, False)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    names = list(settings)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            ahead, runs = settings[name]
            with contextlib.ExitStack() as stack:
                stack.enter_context(fetch.copy_ahead.set(ahead))
                stack.enter_context(fetch.staged_copy_runs.set(runs))
                cold()
                times[name].append(statistics.median(cold() for _ in range(repeats)))
    base = statistics.median(times["both off"])
    for name, ts in times.items():
        mid = statistics.median(ts)
        print(f"staged A/B {name:15s}: {1000 * mid:6.1f} ms (rounds {', '.join(f'{1000 * t:.1f}' for t in ts)}), "
              f"{base / mid:.3f}x of both off")


if __name__ == "__main__":
    main()
