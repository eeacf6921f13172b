"""A served engine's first turns after its warm-up: time each and count the kernel variants it compiled.

A server compiles its kernels and captures its graphs in `warm_up` before the first request (rules of
the hot path, 9, ARCHITECTURE.md). What the warm-up misses, the first request that needs it pays for,
seconds at a time. This loads a checkpoint as `moestream serve` does (`--streams` rows, paged cache,
prefix cache, the auto prompt chunk), swaps in `--routing`, warms up, then runs an agent's first turns
one after the other, each to `--gen-tokens` tokens:

1. a long first prompt (`--prompt-tokens` random ids);
2. another of the same length with new ids (the same work, nothing left to compile: the baseline);
3. the first prompt cached, plus `--new-tokens` (the next turn; its decode reaches a longer context);
4. that turn cached, plus `--new-tokens` again.

Per turn: the wall time (device synchronized) and the Triton kernels whose variants grew, by name. A
warm-up that covers a turn's kernels shows 0 on every row, and turn 1 about as fast as turn 2. The
turns decode greedily unless `--temperature` (with `--top-k`, `--top-p`) asks for a client's sampling.

    python benchmarks/first_turn_compiles.py --ckpt /tmp/q4.gguf --out /tmp/ftc --capacity 32 --routing model \\
        [--streams 4] [--prompt-tokens 16384]
    python benchmarks/first_turn_compiles.py --ckpt moestream/demo_model --out /tmp/ftc --device cpu \\
        --prompt-tokens 40 --new-tokens 6 --gen-tokens 2 --prefix-cache-memory 64MiB   # a smoke run
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import engine_args, log, write_result  # noqa: E402


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernel name → variants compiled between two `kernels.compiled_variants()` readings."""
    return {name: count - before.get(name, 0) for name, count in after.items() if count > before.get(name, 0)}


def main() -> None:
    ap = engine_args(__doc__, streams=1, routing="model")
    ap.add_argument("--prompt-tokens", type=int, default=16384, help="the first turn's prompt")
    ap.add_argument("--new-tokens", type=int, default=300, help="new tokens of each later turn")
    ap.add_argument("--gen-tokens", type=int, default=24, help="tokens generated per turn")
    ap.add_argument("--prefix-cache-memory", default="8GiB")
    ap.add_argument("--temperature", type=float, default=0.0, help="the turns' sampling (0: greedy, as the warm-up)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    if min(args.prompt_tokens, args.gen_tokens, args.streams) < 1 or args.new_tokens < 0:
        ap.error("--prompt-tokens, --gen-tokens and --streams must be at least 1, --new-tokens at least 0")

    import moestream
    from moestream import kernels
    from moestream.bench.routing import apply_routing

    context = args.prompt_tokens + 2 * (args.new_tokens + args.gen_tokens) + args.gen_tokens + 64
    t0 = time.perf_counter()
    engine = moestream.load(str(args.ckpt), device=args.device, dtype=args.dtype, gpu_memory=args.gpu_memory,
                            capacity=args.capacity, max_batch=args.streams, kv_rows=args.streams,
                            max_context=context, prefix_cache_memory=args.prefix_cache_memory)
    load_s = time.perf_counter() - t0
    apply_routing(engine, args.routing, args.trace)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    before = kernels.compiled_variants()
    t0 = time.perf_counter()
    engine.warm_up(8)   # as `moestream serve` starts
    sync()
    warm_s = time.perf_counter() - t0
    warm_variants = sum(grown(before, kernels.compiled_variants()).values())
    log(f"load {load_s:.1f} s, warm-up {warm_s:.1f} s ({warm_variants} variants compiled)")

    rng = random.Random(0)
    vocab = engine.config.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    rows = []

    def turn(label: str, prompt: list[int]) -> list[int]:
        before = kernels.compiled_variants()
        sync()
        t0 = time.perf_counter()
        reply = engine.generate(prompt, max_tokens=args.gen_tokens, ignore_eos=True, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=0)
        sync()
        seconds = time.perf_counter() - t0
        new = grown(before, kernels.compiled_variants())
        rows.append({"turn": label, "prompt_tokens": len(prompt), "seconds": seconds,
                     "variants_compiled": sum(new.values()), "kernels": new})
        names = ", ".join(f"{name.rsplit('.', 1)[-1]} {count}" for name, count in new.items())
        log(f"{label}: {len(prompt)} tokens, {seconds:.3f} s, {sum(new.values())} variants compiled"
            + (f" ({names})" if new else ""))
        return reply

    first = ids(args.prompt_tokens)
    reply = turn("first prompt", first)
    turn("another prompt, new ids", ids(args.prompt_tokens))
    second = first + reply + ids(args.new_tokens)
    reply = turn("next turn, prefix cached", second)
    turn("the turn after", second + reply + ids(args.new_tokens))
    write_result(args.out, "first_turn_compiles", {
        "checkpoint": str(args.ckpt), "device": str(engine.device), "capacity": args.capacity,
        "routing": args.routing, "streams": args.streams,
        "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}, "context": context, "load_s": load_s, "warm_up_s": warm_s,
        "warm_up_variants": warm_variants, "turns": rows, "command": " ".join([sys.executable, *sys.argv])})


if __name__ == "__main__":
    main()
