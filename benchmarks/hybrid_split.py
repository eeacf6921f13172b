"""The hybrid miss policy's split and refresh, side by side on one loaded engine: batch-1 decode at a
bounded bank under each variant, in rounds (variant order repeated), so every variant sees the
same machine, checkpoint and bank.

    python3 benchmarks/hybrid_split.py --ckpt /tmp/q3 --out $OUT [--capacity 32] [--rounds 2]
        [--routing uniform trace] [--variants 0.6 0.6:whole 0.6:every8 0.5 0.7 auto 0.6:nopromote]

A variant is `SHARE[:whole][:everyN][:nopromote][:eager][:pfBYTES][:sync]`: the CPU's share of a one-token
call's misses (`auto`: the default balance, from its starting share), `whole` splits whole experts only
(no expert shared by both sides), `everyN` refreshes the bank every N tokens instead of the default,
`nopromote` never promotes, `eager` promotes as if promotions always paid (every refresh up to
`PROMOTE_MOST`, never one probe at a time), `pfBYTES` sets the CPU kernel's prefetch distance (default:
the kernel's own, `cpu_moe.PREFETCH_BYTES`), `sync` turns the engine's overlap off (each step's token
read before the next step is launched). Each row gives decode tok/s, the bank's hit rate, the bytes per token
copied into the bank, computed by the CPU and read in place by the GPU, the CPU worker's busy
time per token, how many split calls had the device wait for the CPU's answer, how long it
waited per call and what share of the calls' time (post to answer) that was: the balance's
signal. Uniform routing: `--temperature 1` sampling, 512-token prompt; trace: the demo model's held-out trace, greedy, 256-token prompt.
Every row draws the same routing (the RNG is seeded per row). By default a row starts with the
bank the last one left (under the trace, later rows start warm: the replay repeats the same
tokens); `--cold` puts the bank and the residency policy back as they were after loading before
each row, so every row starts as a freshly loaded engine does. The engine's experts are those of
the checkpoint (a converted one gives quantized rows).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import log, step_kernels, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.bench import apply_routing, run_bench  # noqa: E402
from moestream.experts.hybrid import PromotionGauge  # noqa: E402
from moestream.kernels import cpu_moe  # noqa: E402

TRACE = Path(__file__).resolve().parent / "traces" / "demo_heldout_trace.json"
NEVER = 1 << 40


@dataclass(frozen=True)
class Variant:
    name: str
    share: float | None          # None: the default balance (auto), from its starting share
    whole: bool = False
    every: int | None = None     # tokens between refreshes (None: the policy's default)
    prefetch: int | None = None  # the CPU kernel's prefetch distance in bytes (None: its default)
    eager: bool = False          # promotion gauges that never turn to probes
    sync: bool = False           # the engine's overlap off

    @classmethod
    def parse(cls, text: str) -> Variant:
        head, *flags = text.split(":")
        share = None if head == "auto" else float(head)
        whole, every, prefetch, eager, sync = False, None, None, False, False
        for flag in flags:
            if flag == "whole":
                whole = True
            elif flag == "eager":
                eager = True
            elif flag == "sync":
                sync = True
            elif flag == "nopromote":
                every = NEVER
            elif flag.startswith("every") and flag[5:].isdigit():
                every = int(flag[5:])
            elif flag.startswith("pf") and flag[2:].isdigit():
                prefetch = int(flag[2:])
            else:
                raise SystemExit(f"unknown variant flag {flag!r} in {text!r}; use whole, everyN, nopromote, eager, "
                                 "pfN or sync.")
        return cls(text, share, whole, every, prefetch, eager, sync)


def apply(engine, variant: Variant, start: float, quantum: int, every: int) -> None:
    """Set the split, the refresh period, the gauges and the overlap of a loaded engine
    (benchmark-only: the engine takes these once, at load)."""
    hybrid = engine.bank.hybrid_misses
    engine.overlap = "off" if variant.sync else "auto"
    for gauge in hybrid.gauges.values():
        gauge.__dict__.pop("most", None)
        if variant.eager:
            gauge.most = lambda eager_most: eager_most
    hybrid.balance.share = start if variant.share is None else variant.share
    hybrid.balance.adaptive = variant.share is None
    hybrid.balance.calls = hybrid.balance.wait_us = hybrid.balance.span_us = 0
    hybrid.quantum = 0 if variant.whole else quantum
    hybrid.refresh_every = variant.every or every
    hybrid.write_split()
    cpu_moe.set_prefetch(variant.prefetch)


def cold_start(engine, policy_state: dict) -> None:
    """The bank and its residency policy as they were after loading (benchmark-only): the policy's
    counts restored, each layer's slots refilled with its initial experts, the refresh window and
    the promotion gauges started again."""
    bank, hybrid = engine.bank, engine.bank.hybrid_misses
    hybrid.land(wait=True)
    bank.policy.__dict__.update(copy.deepcopy(policy_state))
    hybrid.gauges = {layer: PromotionGauge() for layer in hybrid.gauges}
    hybrid._window[:] = 0
    hybrid._since_refresh = hybrid._due_tokens = 0
    hybrid._balance_window = [0, 0, 0, 0]
    bank.fill()
    hybrid.sync_maps()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--routing", nargs="+", default=["uniform", "trace"], choices=["uniform", "trace"])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--variants", nargs="+", default=["0.6", "0.6:whole", "0.6:every8", "0.6:whole:every8", "0.5",
                                                       "0.7", "0.65", "auto", "0.6:nopromote"])
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[512, 256], help="uniform, trace")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--cold", action="store_true", help="start every row from the bank as loaded")
    ap.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                    help="after the rows, profile this many decode steps (uniform routing, the last row's split) and "
                         "print where a layer's time goes between the post and collect launches")
    args = ap.parse_args()
    variants = [Variant.parse(v) for v in args.variants]
    args.out.mkdir(parents=True, exist_ok=True)
    on_cpu = args.device == "cpu"   # a smoke run on a tiny checkpoint
    engine = moestream.load(args.ckpt, device=args.device, dtype="float32" if on_cpu else "bfloat16",
                            capacity=args.capacity, host_tier="pinned", miss_policy="hybrid",
                            **({} if on_cpu else {"max_context": 4096}))
    hybrid = engine.bank.hybrid_misses
    fmt = engine.bank.formats[0].name
    policy_state = copy.deepcopy(engine.bank.policy.__dict__)
    start, quantum, every = hybrid.balance.share, hybrid.quantum, hybrid.refresh_every
    waits = [0, 0, 0, 0]
    observe = hybrid.balance.observe

    def counting(*window: int) -> bool:   # the balance's signal, counted for every variant
        waits[:] = [a + b for a, b in zip(waits, window)]
        return observe(*window)

    hybrid.balance.observe = counting
    rows = []
    for kind in args.routing:
        routing = apply_routing(engine, kind, args.trace)
        prompt, temperature = (args.prompt_tokens[0], 1.0) if kind == "uniform" else (args.prompt_tokens[1], 0.0)
        for rnd in range(args.rounds):
            for variant in variants:
                if args.cold:
                    cold_start(engine, policy_state)
                apply(engine, variant, start, quantum, every)
                waits[:] = [0, 0, 0, 0]
                torch.manual_seed(0)             # the same sampling draws for every row,
                engine.runner.reset_routing()    # and the same routing draws (warm-up included)
                r = run_bench(engine, prompt, args.gen_tokens, temperature=temperature, routing=routing)
                row = {"routing": kind, "variant": variant.name, "round": rnd, "decode_tok_s": r.decode_tok_s,
                       "hit_rate": r.decode_hit_rate, "copied_mb": r.decode_bytes_per_token / 1e6,
                       "cpu_mb": r.decode_cpu_bytes_per_token / 1e6,
                       "read_mb": r.decode_host_read_bytes_per_token / 1e6,
                       "cpu_busy_ms": r.decode_cpu_busy_s_per_token * 1e3,
                       "split_calls": waits[0], "waited": waits[1],
                       "wait_us_per_call": waits[2] / max(waits[0], 1), "wait_share": waits[2] / max(waits[3], 1),
                       "share_at_end": hybrid.balance.share}
                rows.append(row)
                log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
                write_result(args.out, "hybrid_split", {"rows": rows, "variants": [asdict(v) for v in variants],
                                                         "capacity": args.capacity, "format": fmt,
                                                         "cold": args.cold})   # rows so far
    if args.timeline:
        apply_routing(engine, "uniform")
        timeline(engine, args.prompt_tokens[0], args.timeline)
    engine.close()


def timeline(engine, prompt_tokens: int, steps: int) -> dict:
    """Where a hybrid decode step's time goes, from the kernels of `steps` graph replays: per MoE
    layer, the device's own side (post end to collect start: hits and in-place reads), the collect
    launch (its wait for the CPU's rows, then the add) and the chain from one layer's collect to the
    next layer's post (attention, router: the CPU has nothing to do then); and the rest of a step
    (the LM head, sampling, the host between steps). The profiler lengthens every launch a little."""
    import collections

    from moestream.runtime.sampling import SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, engine.config.vocab_size, (prompt_tokens,), generator=gen).tolist()
    events = step_kernels(engine, prompt, steps, 16,
                          SamplingParams(max_tokens=steps + 24, ignore_eos=True, temperature=1.0))
    if not events:
        log("timeline: the profiler saw no kernels (a CUDA device is needed)")
        return {}
    end = [e["ts"] + e["dur"] for e in events]
    posts = [i for i, e in enumerate(events) if "_post_kernel" in e["name"]]
    collects = [i for i, e in enumerate(events) if "_collect_kernel" in e["name"]]
    collects = [c for c in collects if c + 1 >= len(events) or "_collect_kernel" not in events[c + 1]["name"]]
    segments = collections.defaultdict(list)
    chain_kernels, between_kernels = collections.Counter(), collections.Counter()
    for p, c in zip(posts, collects):   # each post with the last collect program of its layer
        first_c = c
        while first_c > p and "_collect_kernel" in events[first_c - 1]["name"]:
            first_c -= 1
        segments["own side (post end to collect start)"].append(events[first_c]["ts"] - end[p])
        segments["collect (wait + add)"].append(end[c] - events[first_c]["ts"])
        nxt = next((q for q in posts if q > c), None)
        if nxt is not None:
            gap = events[nxt]["ts"] - end[c]
            key = "chain to the next post" if gap < 400 else "between steps (last layer to next step's first post)"
            segments[key].append(gap)
            for e in events[c + 1:nxt]:
                (chain_kernels if gap < 400 else between_kernels)[e["name"][:60]] += e["dur"]
    total = (end[-1] - events[0]["ts"]) / steps
    out = {"us_per_step": total, "layers_per_step": len(posts) / steps}
    log(f"timeline: {total:.0f} us per step, {len(posts) / steps:.0f} posts per step")
    for key, vals in segments.items():
        mean = sum(vals) / max(len(vals), 1)
        out[key] = mean
        log(f"  {key:55s} mean {mean:8.1f} us  over {len(vals)}  ({mean * len(vals) / steps / total:5.1%} of a step)")
    n_chain = max(len(segments["chain to the next post"]), 1)
    log("  kernels in the chain, us per layer:")
    for name, dur in chain_kernels.most_common(16):
        log(f"    {dur / n_chain:7.2f}  {name}")
    n_steps = max(len(segments["between steps (last layer to next step's first post)"]), 1)
    log("  kernels between steps, us per step:")
    for name, dur in between_kernels.most_common(12):
        log(f"    {dur / n_steps:7.2f}  {name}")
    return out


if __name__ == "__main__":
    main()
