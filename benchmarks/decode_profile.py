"""Where a decode step's time goes: per-kernel CUDA time of eager steps, and the graph replay time.

With --ab-fused, first the CUDA-graph decode with the fused small ops (norms, q/k norm + rotary,
router top-k) on and off, alternating (on, off, off, on: figures drift between runs), same process,
same weights, the model's own routing. With --ab-kv, the same alternation between the two KV
layouts: one full-context row per sequence (SDPA over a power-of-two length bucket) and the paged
cache (blocks read in place by the flash-decoding kernel, each row to its own length); the second
engine is loaded beside the first, so the device must hold the weights twice.

    python benchmarks/decode_profile.py CHECKPOINT [--steps 20] [--capacity N] [--ab-fused] [--ab-kv]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--ab-fused", action="store_true", help="decode tok/s with the fused small ops on and off")
    ap.add_argument("--ab-kv", action="store_true", help="decode tok/s with the rows and the paged KV layout")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile of eager steps")
    args = ap.parse_args()
    engine = moestream.load(args.model, device="cuda", dtype="bfloat16", capacity=args.capacity, max_context=4096)
    prompt = list(range(100, 100 + args.prompt_tokens))
    def timed(label: str) -> None:
        engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)   # compile, capture
        engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
        tok_s = engine.last_metrics.decode_tok_s
        print(f"{label}: {tok_s:.1f} tok/s ({1000 / max(tok_s, 1e-9):.2f} ms/token)")

    if args.ab_kv:
        paged = moestream.load(args.model, device="cuda", dtype="bfloat16", capacity=args.capacity, max_context=4096,
                               kv_layout="paged")
        runs = {"rows": [], "paged": []}
        for layout, eng in (("rows", engine), ("paged", paged), ("paged", paged), ("rows", engine)):
            eng.generate(prompt, max_tokens=args.steps, ignore_eos=True)
            eng.generate(prompt, max_tokens=args.steps, ignore_eos=True)
            runs[layout].append(eng.last_metrics.decode_tok_s)
            print(f"kv {layout}: {runs[layout][-1]:.1f} tok/s", flush=True)
        rows, pages = sum(runs["rows"]) / 2, sum(runs["paged"]) / 2
        print(f"prompt {args.prompt_tokens}: kv rows {rows:.1f} tok/s, paged {pages:.1f} tok/s: {pages / rows:.2f}x")
        del paged
    if args.ab_fused:
        from moestream.kernels import fused_ops

        runs: dict[bool, list[float]] = {True: [], False: []}
        for on in (True, False, False, True):
            engine.runner.drop_graphs()
            with fused_ops(on):
                engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
                engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
            runs[on].append(engine.last_metrics.decode_tok_s)
            print(f"fused ops {'on' if on else 'off'}: {runs[on][-1]:.1f} tok/s", flush=True)
        on, off = sum(runs[True]) / 2, sum(runs[False]) / 2
        print(f"fused ops on {on:.1f} tok/s, off {off:.1f} tok/s: {on / off:.2f}x")
        engine.runner.drop_graphs()
    timed("cuda graphs")
    if args.no_profile:
        return
    with engine.runner.eager():
        timed("eager")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
