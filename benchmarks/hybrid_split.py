"""The hybrid miss policy's split and refresh, side by side on one loaded engine: batch-1 decode at a
bounded bank under each variant, in rounds (variant order repeated), so every variant sees the
same machine, checkpoint and bank.

    python3 benchmarks/hybrid_split.py --ckpt /tmp/q3 --out $OUT [--capacity 32] [--rounds 2]
        [--routing uniform trace] [--variants 0.6 0.6:whole 0.6:every8 0.5 0.7 auto 0.6:nopromote]

A variant is `SHARE[:whole][:everyN][:nopromote]`: the CPU's share of a one-token call's misses
(`auto`: the default balance, from its starting share), `whole` splits whole experts only (no
expert shared by both sides), `everyN` refreshes the bank every N tokens instead of the default,
`nopromote` never promotes. Each row gives decode tok/s, the bank's hit rate, the bytes per token
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
from benchmarks.common import log, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.bench import apply_routing, run_bench  # noqa: E402
from moestream.experts.hybrid import HybridMisses, PromotionGauge  # noqa: E402

TRACE = Path(__file__).resolve().parent / "traces" / "demo_heldout_trace.json"
NEVER = 1 << 40


@dataclass(frozen=True)
class Variant:
    name: str
    share: float | None          # None: the default balance (auto), from its starting share
    whole: bool = False
    every: int | None = None     # tokens between refreshes (None: the policy's default)

    @classmethod
    def parse(cls, text: str) -> Variant:
        head, *flags = text.split(":")
        share = None if head == "auto" else float(head)
        whole, every = False, None
        for flag in flags:
            if flag == "whole":
                whole = True
            elif flag == "nopromote":
                every = NEVER
            elif flag.startswith("every") and flag[5:].isdigit():
                every = int(flag[5:])
            else:
                raise SystemExit(f"unknown variant flag {flag!r} in {text!r}; use whole, everyN or nopromote.")
        return cls(text, share, whole, every)


def apply(hybrid: HybridMisses, variant: Variant, start: float, quantum: int, every: int) -> None:
    """Set the split and the refresh period of a loaded policy (benchmark-only: the engine takes
    these once, at load)."""
    hybrid.balance.share = start if variant.share is None else variant.share
    hybrid.balance.adaptive = variant.share is None
    hybrid.balance.calls = hybrid.balance.wait_us = hybrid.balance.span_us = 0
    hybrid.quantum = 0 if variant.whole else quantum
    hybrid.refresh_every = variant.every or every
    hybrid.write_split()


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
                apply(hybrid, variant, start, quantum, every)
                waits[:] = [0, 0, 0, 0]
                torch.manual_seed(0)   # the same routing draws for every row
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
    engine.close()


if __name__ == "__main__":
    main()
