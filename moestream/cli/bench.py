"""`moestream bench`: TTFT, prefill and decode speed, hit rate and bytes moved, under the model's
routing, uniform random routing or a replayed trace."""

from __future__ import annotations

from moestream.cli.common import check_output, checked_model, emit_json, load_engine, stats_text
from moestream.cli.flags import add_json_arg, add_load_args, add_profile_args, integer, number
from moestream.errors import InputError


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure TTFT, prefill and decode speed, hit rate and bytes moved")
    add_load_args(bench)
    bench.add_argument("--prompt-tokens", type=integer(1), default=512, help="random prompt tokens (default 512)")
    bench.add_argument("--gen-tokens", type=integer(1), default=128, help="tokens to decode (default 128)")
    bench.add_argument("--prompt-repeats", type=integer(0), default=3,
                       help="fresh prompts timed besides the decode run's; the time to first token is the median (default 3)")
    bench.add_argument("--seed", type=integer(0, 2**63 - 1), default=0, help="seed of the prompt and the sampling (default 0)")
    bench.add_argument("--temperature", type=number(0), default=0.0,
                       help="sample the decoded tokens (seeded; default 0: greedy); use 1.0 on random-weight checkpoints for "
                            "near-uniform routing")
    bench.add_argument("--routing", choices=["model", "uniform"], default="model",
                       help="uniform: replace the model's expert choice by uniform random experts (worst case for the bank; labelled)")
    bench.add_argument("--stats", action="store_true", help="also print the per-layer table")
    add_json_arg(bench, "the results and the bank's statistics")
    bench.add_argument("--routing-trace", default=None,
                       help="replay the expert choices of a routing trace from `moestream profile --trace` (labelled)")
    add_profile_args(bench)
    bench.set_defaults(func=run)


def run(args) -> int:
    check_output(args.json, "--json")
    checked_model(args)
    from moestream.bench import run_bench

    trace = None
    if args.routing_trace is not None:
        from moestream.warmstart.trace import RoutingTrace

        if args.routing == "uniform":
            raise InputError("give either --routing uniform or --routing-trace, not both.")
        trace = RoutingTrace.load(args.routing_trace)   # a bad trace fails before the weights load
    engine, load_s = load_engine(args)
    routing = None
    if args.routing == "uniform" or trace is not None:
        from moestream.bench import TraceRouting, UniformRouting, use_routing

        routing = (UniformRouting(engine.config.top_k, engine.device) if trace is None else TraceRouting.for_engine(trace, engine))
        use_routing(engine, routing)
    result = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s, seed=args.seed,
                       temperature=args.temperature, routing=routing, prompt_repeats=args.prompt_repeats)
    if args.json != "-":
        print(result.table())
        if args.stats:
            print(stats_text(engine))
    if args.json:
        emit_json(args.json, {**result.as_dict(), "stats": engine.stats()})
    return 0

