"""How much a bank of C experts a layer can hold of a routing trace, and how many experts a batch routes.

A bank's hit rate under a routing is bounded by the routing itself, whatever the policy: a fixed set of
C experts per layer serves at most the share of the trace's (token, expert) pairs that its C most used
experts take (`static`); a policy that could swap its whole bank every `--window` tokens for that
window's C most used serves at most `window` (an oracle: it sees the future, and costs no copies). And a
decode step of B streams at a bank pays for the distinct experts its B tokens route outside the bank,
so the distinct experts of B consecutive tokens (`distinct`) bound what batching shares. Per trace layer
and overall, from a trace recorded by `moestream profile MODEL --prompts FILE --out PROFILE --trace TRACE`
(`benchmarks/traces/` ships the demo model's). No model, no GPU: the trace file alone.

    python benchmarks/trace_locality.py --trace benchmarks/traces/demo_heldout_trace.json --out /tmp/loc \\
        [--capacity 32] [--window 128] [--batch 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, write_result  # noqa: E402
from moestream.warmstart.trace import RoutingTrace  # noqa: E402


def top_share(ids: np.ndarray, num_experts: int, capacity: int) -> float:
    """The share of the routed pairs in `ids` (tokens, k) that its `capacity` most used experts take."""
    counts = np.bincount(ids.ravel(), minlength=num_experts)
    return float(np.sort(counts)[::-1][:capacity].sum() / ids.size)


def layer_locality(ids: np.ndarray, num_experts: int, capacity: int, window: int, batch: int) -> dict:
    """`ids`: one layer's (tokens, k) routing. Whole windows and batches only (a ragged tail is left out)."""
    tokens = ids.shape[0]
    windows = [top_share(ids[s:s + window], num_experts, capacity) for s in range(0, tokens - window + 1, window)]
    distinct = [len(np.unique(ids[s:s + batch])) for s in range(0, tokens - batch + 1, batch)]
    return {"static": top_share(ids, num_experts, capacity),
            "window": float(np.mean(windows)) if windows else None,
            "distinct": float(np.mean(distinct)) if distinct else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--capacity", type=int, default=None, help="bank slots a layer (default: a quarter of the experts)")
    ap.add_argument("--window", type=int, default=128, help="tokens the oracle keeps one bank for")
    ap.add_argument("--batch", type=int, default=16, help="streams of a decode step")
    args = ap.parse_args()
    trace = RoutingTrace.load(args.trace)
    E = trace.num_experts
    capacity = args.capacity if args.capacity is not None else E // 4
    if not 1 <= capacity <= E or args.window < 1 or args.batch < 1:
        ap.error(f"--capacity must be 1..{E}, --window and --batch at least 1")
    layers = [layer_locality(trace.ids[:, i], E, capacity, args.window, args.batch) for i in range(len(trace.layers))]

    def mean(key: str) -> float | None:
        values = [layer[key] for layer in layers if layer[key] is not None]
        return float(np.mean(values)) if values else None

    log(f"{trace.name}: {trace.tokens} tokens, {len(layers)} layers, {E} experts, top-{trace.top_k}; "
        f"bank {capacity} a layer, oracle window {args.window}, batch {args.batch}")
    log("layer  static  window  distinct")
    for layer, row in zip(trace.layers, layers):
        log(f"{layer:>5}  {row['static']:6.1%}  {row['window'] or 0:6.1%}  {row['distinct'] or 0:8.1f}")
    log(f"  all  {mean('static'):6.1%}  {mean('window') or 0:6.1%}  {mean('distinct') or 0:8.1f}")
    write_result(args.out, "trace_locality", {
        "trace": str(args.trace), "tokens": trace.tokens, "num_experts": E, "top_k": trace.top_k,
        "capacity": capacity, "window": args.window, "batch": args.batch,
        "layers": [{"layer": layer, **row} for layer, row in zip(trace.layers, layers)],
        "mean": {key: mean(key) for key in ("static", "window", "distinct")}})


if __name__ == "__main__":
    main()
