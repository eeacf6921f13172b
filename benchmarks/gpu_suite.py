"""One GPU session's measurements, in one process where it can: see BENCHMARKS.md for results.

    python benchmarks/gpu_suite.py --phase foundation --ckpt /tmp/q3 --layers 24 --out $OUT
    python benchmarks/gpu_suite.py --phase budgets    --ckpt /tmp/q3 --layers 24 --out $OUT

foundation: random Qwen3-30B-A3B-shaped checkpoint, moestream resident bf16 batch-1 decode vs HF
            transformers (grouped_mm) on the same weights.
budgets:    moestream at budgets holding 100/50/25/15% of the expert bytes (one pinned host tier
            shared between them), HF + accelerate offload at the 25% budget, the measured
            pinned host→device bandwidth and the transfer roofline.
Routing: random weights (near-uniform routing, a worst case for caching).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import moestream  # noqa: E402
from moestream.bench import UniformRouting, run_bench, set_routing  # noqa: E402
from moestream.experts.trace import RoutingTrace, TraceRouting  # noqa: E402
from moestream.experts.budget import format_bytes, plan_memory  # noqa: E402


def log(*a):
    print(*a, flush=True)


def make_checkpoint(ckpt: Path, layers: int) -> None:
    if (ckpt / "model.safetensors.index.json").exists():
        return
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "scripts/make_random_checkpoint.py"), "--shape", "qwen3-30b-a3b",
                    "--layers", str(layers), "--dtype", "bf16", "--out", str(ckpt), "--device", "cuda"], check=True)
    log(f"checkpoint written in {time.perf_counter() - t0:.1f} s")


def pinned_bandwidth() -> dict:
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 5 * n / (time.perf_counter() - t0)
    # one expert at a time, as the bank copies them (9.4 MB each for this shape)
    chunk = 3 * 768 * 2048 * 2
    t0 = time.perf_counter()
    for i in range(100):
        off = (i * chunk) % (n - chunk)
        dev[off:off + chunk].copy_(host[off:off + chunk], non_blocking=True)
    torch.cuda.synchronize()
    per_expert = 100 * chunk / (time.perf_counter() - t0)
    del host, dev
    return {"pinned_h2d_GBps": h2d / 1e9, "pinned_h2d_per_expert_GBps": per_expert / 1e9}


def hf(ckpt: Path, mode: str, out: Path, extra: list[str], timeout: int) -> dict | None:
    path = out / f"hf_{mode}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/hf_baseline.py"), str(ckpt), "--mode", mode, "--json", str(path), *extra]
    log("$", " ".join(cmd))
    try:
        subprocess.run(cmd, check=True, timeout=timeout)
        return json.loads(path.read_text())
    except Exception as exc:  # the peer failing must not lose our own numbers
        log(f"HF {mode} failed: {exc}")
        return None


def foundation(args) -> dict:
    t0 = time.perf_counter()
    engine = moestream.load(args.ckpt, device="cuda", dtype="bfloat16", capacity=None, max_context=4096)
    load_s = time.perf_counter() - t0
    res = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s, temperature=args.temperature)
    log(res.table())
    ours = res.as_dict()
    del engine
    torch.cuda.empty_cache()
    peer = hf(args.ckpt, "resident", args.out, ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", "32"], 400)
    return {"moestream_resident": ours, "hf_resident": peer}


def budgets(args) -> dict:
    from moestream.experts.host_tier import PinnedHostTier

    results = {"bandwidth": pinned_bandwidth()}
    log(results["bandwidth"])
    bw = results["bandwidth"]["pinned_h2d_GBps"] * 1e9
    tier = None
    variants = {"on": [True], "off": [False], "both": [True, False]}[args.prefetch]
    for frac, prefetch in [(f, p) for f in args.fractions for p in variants]:
        t0 = time.perf_counter()
        probe = moestream.load(args.ckpt, device="cuda", dtype="bfloat16", capacity=8, host_tier="disk",
                               max_context=4096) if tier is None else None
        if tier is None:
            t1 = time.perf_counter()
            tier = PinnedHostTier(probe.bank.store, torch.bfloat16)
            log(f"pinned host tier: {format_bytes(tier.nbytes())} in {time.perf_counter() - t1:.1f} s")
            config = probe.config
            del probe
            torch.cuda.empty_cache()
        cap = max(config.top_k, round(config.num_experts * frac))
        budget = plan_memory(config, torch.bfloat16, capacity=cap, max_context=4096).total_bytes
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        pinned = _pins_from_profile(args.pin_profile, args.pin_top_k, config) if args.pin_top_k else None
        engine = moestream.load(args.ckpt, device="cuda", dtype="bfloat16", gpu_memory=budget, max_context=4096,
                                pinned=pinned,
                                host_tier=tier if cap < config.num_experts else "auto", residency=args.residency,
                                prefetch=prefetch)
        load_s = time.perf_counter() - t0
        if args.routing == "uniform":
            set_routing(engine, UniformRouting(config.top_k))
        elif args.routing == "trace":
            replay = TraceRouting.for_engine(RoutingTrace.load(args.trace), engine)
            replay.prediction_accuracy = args.trace_prediction_accuracy
            set_routing(engine, replay)
        res = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s, temperature=args.temperature).as_dict()
        res["expert_fraction"] = frac
        res["prefetch"] = prefetch
        res["pin_top_k"] = args.pin_top_k
        stats = engine.stats()
        res["prediction_accuracy"] = stats["prediction_accuracy"]
        res["prefetched"] = stats["prefetched"]
        res["within_budget"] = res["peak_device_bytes"] <= budget
        missed = res["decode_bytes_per_token"]
        res["roofline_tok_s"] = bw / missed if missed else None
        res["share_of_roofline"] = res["decode_tok_s"] / res["roofline_tok_s"] if missed else None
        log(f"--- {frac:.0%} of experts: capacity {cap}, budget {format_bytes(budget)}, prefetch {prefetch}, routing {res['routing']}")
        log(json.dumps({k: res[k] for k in ("decode_tok_s", "ttft_s", "decode_hit_rate", "decode_bytes_per_token", "prediction_accuracy", "prefetched",
                                             "roofline_tok_s", "share_of_roofline", "peak_device_bytes", "within_budget")}))
        results[f"moestream_{int(frac * 100)}" + ("" if prefetch else "_noprefetch")] = res
        del engine
        torch.cuda.empty_cache()
    del tier
    if args.hf_offload:
        frac = 0.25
        budget = results[f"moestream_{int(frac * 100)}"]["budget_bytes"]
        results["hf_offload_25"] = hf(args.ckpt, "offload", args.out,
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["foundation", "budgets"], required=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.15])
    ap.add_argument("--residency", default="lcp")
    ap.add_argument("--hf-offload", action="store_true")
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default="model")
    ap.add_argument("--trace", type=Path, default=None, help="routing trace to replay with --routing trace")
    ap.add_argument("--prefetch", choices=["on", "off", "both"], default="on")
    ap.add_argument("--pin-profile", type=Path, default=None, help="profile whose top experts get pinned (layers mapped modulo)")
    ap.add_argument("--pin-top-k", type=int, default=0)
    ap.add_argument("--trace-prediction-accuracy", type=float, default=None,
                    help="under trace replay, predict the next layer's replayed experts with this accuracy "
                         "(the demo model's measured next-layer accuracy is 0.65)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampled decode keeps random-weight routing diverse")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log(torch.cuda.get_device_name(), torch.__version__)
    make_checkpoint(args.ckpt, args.layers)
    result = foundation(args) if args.phase == "foundation" else budgets(args)
    result["machine"] = torch.cuda.get_device_name()
    result["date"] = time.strftime("%Y-%m-%d")
    result["layers"] = args.layers
    (args.out / f"suite_{args.phase}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
