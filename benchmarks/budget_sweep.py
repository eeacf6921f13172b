"""Decode at memory budgets: moestream with banks holding 100/50/25/15% of the experts, the rest in pinned host RAM.

    python benchmarks/budget_sweep.py --ckpt /tmp/q3 --out $OUT [--fractions 1 0.5 0.25 0.15]
        [--routing model|uniform|trace --trace benchmarks/traces/demo_heldout_trace.json]
        [--prefetch on|off|both] [--pin-profile P --pin-top-k K] [--hf-offload] [--max-context 4096]

Each budget is what `plan_memory` says its capacity needs with the cache layout the engine picks;
one pinned host tier is filled once and shared by every budget's bank. Also measured: the pinned host→device bandwidth, from which each
row's transfer roofline (bandwidth ÷ bytes missed per token) follows. `--hf-offload` adds HF
transformers + accelerate offload at the 25% budget as the peer. Results: `$OUT/budget_sweep.json`.
Routing is stated per row: the model's own, uniform (synthetic worst case) or a replayed trace.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import checkpoint_args, ensure_checkpoint, hf_peer, log, pinned_bandwidth, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.bench import TraceRouting, apply_routing, run_bench, use_routing  # noqa: E402
from moestream.engine.plan import plan_memory  # noqa: E402
from moestream.experts.host_tier import PinnedHostTier  # noqa: E402
from moestream.sizes import format_bytes  # noqa: E402


def budgets(args) -> dict:
    results = {"bandwidth": pinned_bandwidth()}
    log(results["bandwidth"])
    bw = results["bandwidth"]["pinned_h2d_GBps"] * 1e9
    tier = None
    variants = {"on": [True], "off": [False], "both": [True, False]}[args.prefetch]
    runs = [(f, p, c, m) for f in args.fractions for m in args.miss_policy for p in variants for c in args.cpu_misses]
    for frac, prefetch, cpu_misses, policy in runs:
        t0 = time.perf_counter()
        top_k = json.loads((args.ckpt / "config.json").read_text()).get("num_experts_per_tok", 8)
        probe = moestream.load(args.ckpt, device="cuda", dtype="bfloat16", capacity=top_k, host_tier="disk",
                               max_context=args.max_context) if tier is None else None
        if tier is None:
            t1 = time.perf_counter()
            tier = PinnedHostTier(probe.bank.store, probe.bank.formats)
            log(f"pinned host tier: {format_bytes(tier.nbytes())} in {time.perf_counter() - t1:.1f} s")
            config = probe.config
            kv = probe.plan.memory   # the cache layout the engine picks (paged: its blocks count in the budget)
            del probe
            torch.cuda.empty_cache()
        least = 1 if policy == "hybrid" else 0   # hybrid serves any miss off the device; 0: top-k
        cap = max(least or config.top_k, round(config.num_experts * frac))
        budget = plan_memory(config, torch.bfloat16, capacity=cap, max_context=args.max_context, min_capacity=least,
                             kv_blocks=kv.kv_blocks, kv_block_size=kv.kv_block_size or 16).total_bytes
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        pinned = _pins_from_profile(args.pin_profile, args.pin_top_k, config) if args.pin_top_k else None
        # Below top-k slots (hybrid only) the capacity is given: the budget's slack is smaller than a slot there.
        sized = {"gpu_memory": budget} if cap >= config.top_k else {"capacity": cap}
        engine = moestream.load(args.ckpt, device="cuda", dtype="bfloat16", **sized, max_context=args.max_context,
                                pinned=pinned,
                                host_tier=tier if cap < config.num_experts else "auto", residency=args.residency,
                                prefetch=prefetch, cpu_misses=cpu_misses if cap < config.num_experts else None,
                                miss_policy=policy if cap < config.num_experts else "fetch",
                                cpu_threads=args.cpu_threads if cap < config.num_experts else None)
        load_s = time.perf_counter() - t0
        routing = apply_routing(engine, args.routing, args.trace)
        if isinstance(routing, TraceRouting) and args.trace_prediction_accuracy is not None:
            routing.prediction_accuracy = args.trace_prediction_accuracy
            use_routing(engine, routing)   # again: prefetch now predicts from the trace
        res = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s, temperature=args.temperature,
                        routing=routing).as_dict()
        res["expert_fraction"] = frac
        res["prefetch"] = prefetch
        res["pin_top_k"] = args.pin_top_k
        stats = engine.stats()
        res["prediction_accuracy"] = stats["prediction_accuracy"]
        res["prefetched"] = stats["prefetched"]
        res["within_budget"] = res["peak_device_bytes"] <= budget
        res["cpu_misses"] = cpu_misses
        missed = res["decode_bytes_per_token"]
        res["roofline_tok_s"] = bw / missed if missed else None   # the PCIe roofline of the copied bytes
        res["share_of_roofline"] = res["decode_tok_s"] / res["roofline_tok_s"] if missed else None
        # host -> compute bandwidth reached: expert bytes copied plus those the CPU read, per second
        res["host_gb_s"] = (missed + res["decode_cpu_bytes_per_token"] + res["decode_host_read_bytes_per_token"]
                            ) * res["decode_tok_s"] / 1e9
        log(f"--- {frac:.0%} of experts: capacity {cap}, budget {format_bytes(budget)}, prefetch {prefetch}, "
            f"miss policy {policy}, cpu misses {cpu_misses}, routing {res['routing']}")
        log(json.dumps({k: res[k] for k in ("decode_tok_s", "ttft_s", "decode_hit_rate", "decode_bytes_per_token",
                                             "decode_cpu_bytes_per_token", "decode_host_read_bytes_per_token",
                                             "decode_cpu_share", "host_gb_s",
                                             "prediction_accuracy", "prefetched", "roofline_tok_s", "share_of_roofline",
                                             "peak_device_bytes", "within_budget")}))
        if engine.bank.fetcher is not None and engine.bank.fetcher.costs is not None:
            res["miss_costs"] = vars(engine.bank.fetcher.costs)
            log(f"miss costs: {res['miss_costs']}")
        key = f"moestream_{int(frac * 100)}" + ("" if prefetch else "_noprefetch")
        key += f"_{policy}" if len(args.miss_policy) > 1 else ""
        results[key + (f"_cpu{cpu_misses}" if len(args.cpu_misses) > 1 else "")] = res
        res["miss_policy"] = policy
        engine.bank.close()
        del engine
        torch.cuda.empty_cache()
    del tier
    if args.hf_offload:
        frac = 0.25
        budget = results[f"moestream_{int(frac * 100)}"]["budget_bytes"]
        results["hf_offload_25"] = hf_peer(args.ckpt, "offload", args.out,
                                      ["--gpu-memory", f"{budget // 2**20}MiB", "--prompt-tokens", "32", "--gen-tokens", "3"], 420)
    return results


def _pins_from_profile(path: Path, top_k: int, config) -> dict[int, list[int]]:
    """The profile's top experts per layer, its layers mapped modulo onto the target's (as traces are)."""
    profile = json.loads(path.read_text())
    layers = [v for _, v in sorted(profile["frequencies"].items(), key=lambda kv: int(kv[0]))]
    moe = [i for i, is_moe in enumerate(config.moe_layers) if is_moe]
    pins = {}
    for n, layer in enumerate(moe):
        freqs = layers[n % len(layers)]
        pins[layer] = sorted(range(len(freqs)), key=lambda e: -freqs[e])[:top_k]
    return pins


def main() -> None:
    ap = checkpoint_args(__doc__)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.15])
    ap.add_argument("--residency", default="lcp")
    ap.add_argument("--max-context", type=int, default=4096, help="context each engine is planned and built for")
    ap.add_argument("--cpu-misses", type=lambda t: t if t == "auto" else float(t), nargs="+", default=[None],
                    help="misses computed on the CPU at bounded budgets: a share, or auto (needs the pinned tier); "
                         "with --miss-policy hybrid the CPU's share of a one-token call's missing experts")
    ap.add_argument("--miss-policy", nargs="+", default=["fetch"], choices=["fetch", "hybrid"],
                    help="exact miss policies to run at each bounded budget")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="threads of the CPU's share of the misses (default: three of every four cores)")
    ap.add_argument("--hf-offload", action="store_true")
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default="uniform")
    ap.add_argument("--trace", type=Path, default=None, help="routing trace to replay with --routing trace")
    ap.add_argument("--prefetch", choices=["on", "off", "both"], default="off")
    ap.add_argument("--pin-profile", type=Path, default=None, help="profile whose top experts get pinned (layers mapped modulo)")
    ap.add_argument("--pin-top-k", type=int, default=0)
    ap.add_argument("--trace-prediction-accuracy", type=float, default=None,
                    help="under trace replay, predict the next layer's replayed experts with this accuracy "
                         "(the demo model's measured next-layer accuracy is 0.65)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log(torch.cuda.get_device_name(), torch.__version__)
    ensure_checkpoint(args.ckpt, args.shape, args.layers)
    result = budgets(args)
    result["layers"] = args.layers
    write_result(args.out, "budget_sweep", result)


if __name__ == "__main__":
    main()
