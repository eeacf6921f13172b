"""Bank hit rates of the hybrid policy's refresh rule, replayed on the CPU (no model, no GPU).

    python benchmarks/refresh_replay.py [--trace benchmarks/traces/demo_heldout_trace.json]
        [--every 4 8] [--act-lag 0 1] [--land-lag 0 1] [--capacity 32] [--gen-tokens 128] [--json out.json]

Routing (per layer): the trace's ids (its layers mapped modulo onto 24), or uniform top-k draws.
The first `--prompt-tokens` tokens seed the residency policy and fill the bank with its ranking, as a
prompt does; then every `--every` tokens the window's use and miss counts go through the policy's
own code (`PromotionGauge`, `choose_promotions`), `--act-lag` tokens after the window closes (a
refresh off the critical path acts on the next step), and each promotion serves hits `--land-lag`
tokens later (its copy landing); `--every 0` keeps the prompt's fill. A layer with promotions in
flight promotes nothing more, as in `HybridMisses`. Prints hit rates, promotions per layer and
token, and how the layer calls spread over their number of misses; all depend on routing, not on
the device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.experts.hybrid import PROMOTE_MOST, PromotionGauge  # noqa: E402
from moestream.experts.residency import LCPPolicy  # noqa: E402
from moestream.experts.skip import choose_promotions  # noqa: E402


class _Layer:
    """What `choose_promotions` reads of a layer's slots: who is resident."""

    def __init__(self, experts: list[int]):
        self.where = {e: s for s, e in enumerate(experts)}

    def resident(self) -> np.ndarray:
        return np.asarray(list(self.where), dtype=np.int64)


def replay(rows: np.ndarray, num_experts: int, capacity: int, prompt: int, every: int, act_lag: int,
           land_lag: int, misses_per_call: np.ndarray | None = None) -> tuple[int, int, int]:
    """One layer's decode: (hits, pairs, promotions); `misses_per_call[m]` counts the calls that
    missed m of their experts, where given."""
    layer = 0
    policy = LCPPolicy(num_experts)
    seen, counts = np.unique(rows[:prompt], return_counts=True)
    policy.record(layer, seen, counts)
    policy.advance(prompt)
    slots = {layer: _Layer(policy.ranking(layer)[:capacity])}
    gauge = PromotionGauge()
    gauge.start(np.bincount(rows[:prompt].reshape(-1), minlength=num_experts))
    use, miss = np.zeros(num_experts, np.int64), np.zeros(num_experts, np.int64)
    pending: list[tuple[int, np.ndarray, np.ndarray, int]] = []   # (tokens to wait, use, miss, window tokens)
    landing: list[tuple[int, list[int]]] = []                      # (tokens to wait, experts)
    hits = pairs = promoted = 0
    for i, row in enumerate(rows[prompt:]):
        for left, experts in [x for x in landing if x[0] <= 0]:
            slots[layer].where.update({e: -1 for e in experts})
        landing = [x for x in landing if x[0] > 0]
        missed = 0
        for e in row:
            pairs += 1
            hit = int(e) in slots[layer].where
            hits += hit
            missed += not hit
            use[e] += 1
            miss[e] += not hit
        if misses_per_call is not None:
            misses_per_call[missed] += 1
        policy.advance(1)
        landing = [(left - 1, experts) for left, experts in landing]
        if every and (i + 1) % every == 0:
            pending.append((act_lag, use.copy(), miss.copy(), every))
            use[:], miss[:] = 0, 0
        due = [p for p in pending if p[0] <= 0]
        pending = [(p[0] - 1, *p[1:]) for p in pending if p[0] > 0]
        for _, u, m, tokens in due:
            gauge.observe(u, tokens)
            most = 0 if landing else gauge.most(PROMOTE_MOST)
            chosen = choose_promotions(slots, policy, layer, m, u, most=most)
            for _, victim in chosen:
                del slots[layer].where[victim]
            incoming = [h for h, _ in chosen]
            if incoming:
                gauge.promoted(incoming)
                promoted += len(incoming)
                if land_lag:
                    landing.append((land_lag, incoming))
                else:
                    slots[layer].where.update({e: -1 for e in incoming})
    return hits, pairs, promoted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=Path(__file__).parent / "traces" / "demo_heldout_trace.json")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--every", type=int, nargs="+", default=[4, 8], help="tokens between refreshes (0: never)")
    ap.add_argument("--act-lag", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--land-lag", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    trace = json.loads(args.trace.read_text())
    ids = np.asarray(trace["ids"])                     # (tokens, trace layers, k)
    E, k = trace["num_experts"], trace["top_k"]
    n = args.prompt_tokens + args.gen_tokens
    if len(ids) < n:
        raise SystemExit(f"the trace has {len(ids)} tokens; --prompt-tokens + --gen-tokens is {n}")
    rng = np.random.default_rng(args.seed)
    uniform = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(n)]) for _ in range(args.layers)])
    results = []
    for every in args.every:
        for act_lag in args.act_lag:
            for land_lag in args.land_lag:
                row = {"every": every, "act_lag": act_lag, "land_lag": land_lag}
                for name, per_layer in (("trace", [ids[:n, layer % ids.shape[1]] for layer in range(args.layers)]),
                                        ("uniform", list(uniform))):
                    h = p = pr = 0
                    calls = np.zeros(k + 1, np.int64)
                    for rows in per_layer:
                        a, b, c = replay(rows, E, args.capacity, args.prompt_tokens, every, act_lag, land_lag, calls)
                        h, p, pr = h + a, p + b, pr + c
                    row[name] = {"hit_rate": h / p, "promotions_per_layer_token": pr / (args.layers * args.gen_tokens),
                                 "calls_by_misses": (calls / calls.sum()).round(3).tolist()}
                results.append(row)
                print(f"every {every}, act lag {act_lag}, land lag {land_lag}: "
                      f"trace {row['trace']['hit_rate']:.1%} hits, {row['trace']['promotions_per_layer_token']:.3f} "
                      f"promotions | uniform {row['uniform']['hit_rate']:.1%}, "
                      f"{row['uniform']['promotions_per_layer_token']:.3f}", flush=True)
                print(f"  share of layer calls missing m = 0, 1, ... experts: trace {row['trace']['calls_by_misses']}"
                      f" | uniform {row['uniform']['calls_by_misses']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"capacity": args.capacity, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
