"""Concurrent streams stepped as the server steps them, one line per step: what each step ran, how long it
took, and which kernels it compiled.

`--streams` requests of `--prompt-tokens` random tokens arrive at once and generate `--gen-tokens` each
(temperature 1, no EOS). The engine is loaded as `moestream serve` loads it (`warm_up`: decode graphs
captured), then, as `serve_throughput.py` drives a server, each measured round follows an unmeasured
one of the same prompts and 16 generated tokens. Every step is logged: its prompt chunks and prompt
tokens, the streams decoding (riding in the step's packed prompt forward, or a decode step of their
own), its wall time and the Triton kernel variants it compiled (a step of a token count not seen
before should compile none: ARCHITECTURE.md, rules of the hot path, 9). Per mode: aggregate decode
tok/s (tokens after each stream's first over the span from the first first-token to the last token, as
`serve_throughput.py` counts them), time to first token p50 and last, the steps over `--slow-ms`.

Modes (`--modes`): `default` (prompts packed into one forward a step, each step filled, decodes riding
in it at a bank), `no-ride` (decodes in a step of their own), `whole` (packed, prompts never cut to
fill a step), `one-each` (a forward per prompt). The routing is stated: the model's own (a
token-routed GGUF spreads it near-uniformly), uniform, or a replayed trace. `--batch-cpu-shares 0.5 0.6 ...`
adds a `default` round per share with the hybrid policy's batch split fixed there (the CPU's share of a
batch's experts outside the bank), then hands the split back to its balance: is the balance where the
steps are shortest? `--prompt-cpu-misses 0 auto ...` adds a default round per share of a streamed prompt
chunk's missing experts computed on the CPU (`moestream --prompt-cpu-misses`), all on one engine. Each
round reports its median step too.

    python benchmarks/served_steps.py --ckpt /tmp/q3.gguf --out /tmp/steps --capacity 32 --routing model --streams 16 \\
        [--modes default --batch-cpu-shares 0.5 0.6 0.7 0.8]
"""

from __future__ import annotations

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
from moestream.cli.flags import chunk_tokens, share_or_auto  # noqa: E402
from moestream.kernels import compiled_variants  # noqa: E402
from moestream.runtime.sampling import SamplingParams  # noqa: E402

MODES = ("default", "no-ride", "whole", "one-each")


def use_mode(engine, mode: str) -> None:
    """Plan the engine's steps as `mode` says (the engine's own plan is `default`)."""
    engine.pack_prompts = mode != "one-each" and engine.runner.packs_prompts
    engine.fill_steps, engine.ride_decodes = mode in ("default", "no-ride"), mode in ("default", "whole")


def one_round(engine, prompts: list[list[int]], gen_tokens: int, steps_log: list | None) -> dict:
    """All prompts added at once, the engine stepped until every stream is done."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    params = SamplingParams(max_tokens=gen_tokens, temperature=1.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    step_ms: list[float] = []   # each step's wall time (s)
    plans: list = []   # each step's plan (none for a decode step launched ahead of its plan)
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda **kw: plans.append(schedule(**kw)) or plans[-1]
    sync()
    t0 = time.perf_counter()
    try:
        while not all(s.finished for s in seqs):
            before, plans[:] = compiled_variants(), []
            start = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            step_ms.append(end - start)
            for i, s in enumerate(seqs):
                if s.sampled:
                    first.setdefault(i, end - t0)
                    last[i] = end - t0
            if steps_log is not None:
                after, plan = compiled_variants(), plans[0] if plans else None
                steps_log.append({"ms": 1000 * (end - start),
                                  "prompt_chunks": len(plan.prefills) if plan else 0,
                                  "prompt_tokens": plan.prefill_tokens if plan else 0,
                                  "decoding": len(plan.decodes) if plan else None,
                                  "compiled": {k.rsplit(".", 1)[1]: v - before.get(k, 0) for k, v in after.items()
                                               if v != before.get(k, 0)}})
    finally:
        engine.scheduler.schedule = schedule
    sync()
    span = max(last.values()) - min(first.values())
    tokens_after_first = sum(s.sampled - 1 for s in seqs)
    return {"decode_tok_s": tokens_after_first / span if span > 0 else 0.0, "steps_taken": len(step_ms),
            "median_step_ms": 1000 * statistics.median(step_ms),
            "ttft_p50_ms": 1000 * statistics.median(first.values()), "ttft_last_ms": 1000 * max(first.values()),
            "seconds": time.perf_counter() - t0}


def run(args) -> dict:
    engine = moestream.load(str(args.ckpt), device=args.device, dtype=args.dtype, capacity=args.capacity,
                            gpu_memory=args.gpu_memory, max_batch=args.streams, kv_rows=args.streams,
                            max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                            prompt_cpu_misses="auto" if any(args.prompt_cpu_misses) else 0.0,
                            cpu_threads=args.cpu_threads,
                            **({"miss_policy": "hybrid", "host_tier": "pinned"} if args.hybrid else {}))
    routing = apply_routing(engine, args.routing, args.trace)
    engine.warm_up(8)   # as `moestream serve` starts
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    hybrid = engine.bank.hybrid_misses if args.batch_cpu_shares else None
    if args.batch_cpu_shares and hybrid is None:
        raise SystemExit("--batch-cpu-shares needs the hybrid miss policy (a bank smaller than the experts, "
                         "on a GPU, with the pinned host tier; --hybrid asks for it)")
    rounds = [(mode, mode, None, None) for mode in args.modes] + \
        [(f"share {share:g}", "default", share, None) for share in args.batch_cpu_shares] + \
        [(f"prompt cpu {share}", "default", None, share) for share in args.prompt_cpu_misses]
    modes = {}
    fetcher = engine.bank.fetcher
    for name, mode, share, prompt_share in rounds:
        use_mode(engine, mode)
        if hybrid is not None:
            hybrid.fix_batch_share(share)
        if fetcher is not None and any(args.prompt_cpu_misses):
            fetcher.prompt_cpu_share = prompt_share if prompt_share is not None else 0.0
        prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
        warm_log: list = []
        one_round(engine, prompts, 16, warm_log)
        engine.reset_stats()
        steps: list = []
        result = one_round(engine, [[rng.randrange(1, vocab) for _ in p] for p in prompts], args.gen_tokens, steps)
        stats, counters = engine.stats(), engine.counters.as_dict()
        split = engine.bank.hybrid_misses
        if split is not None:   # the last window of split batches: the device's wait for the CPU, the CPU's span
            b = split.batch_balance
            result.update(batch_cpu_share=split.batch_cpu_share, batch_wait_us=b.wait_us_per_call,
                          batch_wait_share=b.wait_share, batch_post_to_answer_us=b.span_us_per_call,
                          layer_ms=result["median_step_ms"] / len(split.layer_index))
        if fetcher is not None:
            result["prompt_cpu_share"] = fetcher.prompt_cpu_share
        modes[name] = {**result, "forwards": counters["prefill_forwards"], "decode_steps": counters["decode_steps"],
                       "decodes_packed": counters["decodes_packed"], "gb_copied": stats.get("bytes_copied", 0) / 1e9,
                       "compiled_unmeasured": sum(sum(s["compiled"].values()) for s in warm_log),
                       "compiled_measured": sum(sum(s["compiled"].values()) for s in steps),
                       "slow_steps": [s for s in steps if s["ms"] > args.slow_ms or s["compiled"]], "steps": steps}
    return {"streams": args.streams, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
            "cpu_threads": args.cpu_threads,
            "capacity": args.capacity, "routing": routing.label if routing is not None else "the model's own",
            "device": str(engine.device), "prefill_chunk": engine.runner.prefill_chunk, "modes": modes}


def main() -> int:
    ap = engine_args(__doc__, streams=16, routing="model")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--prefill-chunk", type=chunk_tokens, default="auto",
                    help="a step's prompt tokens (default auto, as `moestream serve` and serve_throughput.py)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--slow-ms", type=float, default=1000.0, help="steps longer than this are listed")
    ap.add_argument("--prompt-cpu-misses", type=share_or_auto, nargs="*", default=[],
                    help="a default-mode round per CPU share of a streamed prompt chunk's misses (0: none; auto)")
    ap.add_argument("--hybrid", action="store_true",
                    help="the hybrid miss policy over a pinned host tier (the default on a GPU at a bank; this asks for it "
                         "anywhere, the CPU included)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="the CPU expert kernel's team (default: moestream's, every core but one up to 16)")
    ap.add_argument("--batch-cpu-shares", type=float, nargs="*", default=[],
                    help="a default-mode round per CPU share of a batch's misses, fixed (hybrid policy)")
    args = ap.parse_args()
    result = run(args)
    for mode, r in result["modes"].items():
        log(f"{mode:>9}: {r['decode_tok_s']:.1f} tok/s decode, median step {r['median_step_ms']:.1f} ms, "
            f"first token p50 {r['ttft_p50_ms']:.0f} ms "
            f"(last {r['ttft_last_ms']:.0f}), {r['forwards']} prompt forwards, {r['decodes_packed']} decode steps "
            f"riding, {r['gb_copied']:.1f} GB copied, kernel variants compiled: {r['compiled_unmeasured']} "
            f"unmeasured, {r['compiled_measured']} measured; {len(r['slow_steps'])} steps over {args.slow_ms:g} ms")
        if r.get("batch_post_to_answer_us") is not None:
            log(f"{'':>9}  a layer {1000 * r['layer_ms']:.0f} µs (median step / layers): the CPU answered "
                f"{r['batch_post_to_answer_us']:.0f} µs after the post, the device waited {r['batch_wait_us']:.0f} µs "
                f"for it; CPU share of the batch's misses {r['batch_cpu_share']:.2f}")
    log(f"{result['streams']} streams of {result['prompt_tokens']} prompt tokens, routing {result['routing']}, "
        f"capacity {result['capacity']}, {result['device']}")
    write_result(args.out, "served_steps", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
