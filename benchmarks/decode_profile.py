"""Where a decode step's time goes: per-kernel CUDA time of eager steps, and the graph replay time.

With --ab-fused, first the CUDA-graph decode with the fused small ops (norms, q/k norm + rotary,
router top-k) on and off, alternating (on, off, off, on: figures drift between runs), same process,
same weights, the model's own routing. With --graph-profile, the per-kernel
time and the gaps between kernels inside the graph replays themselves. With --ab-pdl, the same alternation with programmatic dependent launch
(kernels/pdl.py) on and off; with --ab-token-quant, with a packed checkpoint's one-token quantized
experts path (kernels/fused_moe_token_quant.py) on and off; with --ab-quant-gemv, with quantized dense
layers' one-row GEMV (kernels/quant_gemv_triton.py) on and off (the decode path); with --ab-overlap, with the engine's overlap
(each step launched before the last one's token is read) on and off; with --ab-sampling, decode at the
Qwen3 model card's sampling (temperature 0.7, top-p 0.8, top-k 20), drawing among the top-k tokens
(`sampling.sample`) against filtering the whole row first; with --ab-draw-kernel, at the same
settings, the two-launch top-k draw (kernels/sampling_triton.py) against its torch launches. With --ab-kv, the same alternation between the two KV
layouts: one full-context row per sequence (SDPA over a power-of-two length bucket) and the paged
cache (blocks read in place by the flash-decoding kernel, each row to its own length); the second
engine is loaded beside the first, so the device must hold the weights twice.

    python benchmarks/decode_profile.py CHECKPOINT [--steps 20] [--capacity N] [--ab-fused] [--ab-kv] [--ab-pdl] [--ab-token-quant] [--ab-quant-gemv] [--ab-overlap] [--ab-sampling] [--ab-draw-kernel]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402


QWEN3_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 0}   # the Qwen3 card's settings


def _import(module: str, name: str):
    """A switch imported when its A/B runs (a checkpoint without quantized experts never loads those)."""
    return lambda engine: getattr(importlib.import_module(module), name)


# --ab-FLAG: (help, label, engine → switch(on) context manager, sampling keywords of the timed runs)
AB_SWITCHES = {
    "fused": ("decode tok/s with the fused small ops on and off", "fused ops",
              _import("moestream.kernels", "fused_ops"), {}),
    "pdl": ("decode tok/s with programmatic dependent launch on and off (Hopper)", "programmatic launch",
            _import("moestream.kernels.pdl", "programmatic_launch"), {}),
    "token-quant": ("the same alternation with quantized experts' one-token path on and off (the decode path)",
                    "one-token quantized path", _import("moestream.kernels.fused_moe_token_quant", "one_token_quant"), {}),
    "quant-gemv": ("the same alternation with quantized dense layers' one-row GEMV on and off (the decode path)",
                   "quantized dense GEMV", _import("moestream.kernels.quant_linear_triton", "quant_gemv_path"), {}),
    "overlap": ("the same alternation with the engine's overlap on and off (the host's work between steps)", "overlap",
                lambda engine: lambda on: overlapping(engine, on), {}),
    "sampling": ("decode tok/s at temperature 0.7, top-p 0.8, top-k 20: top-k first against the whole row filtered",
                 "sampling top-k first", lambda engine: top_k_first, QWEN3_SAMPLING),
    "draw-kernel": ("decode tok/s at the same settings: the two-launch top-k draw against its torch launches",
                    "top-k draw kernel", _import("moestream.runtime.sampling", "draw_kernel"), QWEN3_SAMPLING),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--ab-kv", action="store_true", help="decode tok/s with the rows and the paged KV layout")
    for flag, (help_text, _, _, _) in AB_SWITCHES.items():
        ap.add_argument(f"--ab-{flag}", action="store_true", help=help_text)
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile of eager steps")
    ap.add_argument("--graph-profile", action="store_true",
                    help="per-kernel time and the gaps between kernels inside decode graph replays instead")
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
    for flag, (_, label, switch, sampling) in AB_SWITCHES.items():
        if getattr(args, "ab_" + flag.replace("-", "_")):
            ab_switch(engine, prompt, args.steps, label, switch(engine), **sampling)
    timed("cuda graphs")
    if args.graph_profile:
        graph_profile(engine, prompt)
        return
    if args.no_profile:
        return
    with engine.runner.eager():
        timed("eager")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompt, max_tokens=args.steps, ignore_eos=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


def ab_switch(engine, prompt: list[int], steps: int, label: str, switch, **sampling) -> None:
    """Decode tok/s with `switch(True)` and `switch(False)` (context managers), alternating on, off,
    off, on (greedy unless `sampling` keywords say otherwise): graphs are captured again for each
    run, since a captured graph keeps the choice."""
    kw = {"max_tokens": steps, "ignore_eos": True, **sampling}
    runs: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False, False, True):
        engine.runner.drop_graphs()
        with switch(on):
            engine.generate(prompt, **kw)
            engine.generate(prompt, **kw)
        runs[on].append(engine.last_metrics.decode_tok_s)
        print(f"{label} {'on' if on else 'off'}: {runs[on][-1]:.1f} tok/s", flush=True)
    on, off = sum(runs[True]) / 2, sum(runs[False]) / 2
    print(f"{label} on {on:.1f} tok/s, off {off:.1f} tok/s: {on / off:.2f}x")
    engine.runner.drop_graphs()


@contextmanager
def top_k_first(on: bool) -> Iterator[None]:
    """`sampling.sample` (top-k first) on, or off: the whole row filtered before the draw."""
    from benchmarks.sampling_time import whole_row
    from moestream.runtime import sampling

    fast = sampling.sample
    sampling.sample = fast if on else whole_row
    try:
        yield
    finally:
        sampling.sample = fast


@contextmanager
def overlapping(engine, on: bool) -> Iterator[None]:
    saved, engine.overlap = engine.overlap, "on" if on else "off"
    try:
        yield
    finally:
        engine.overlap = saved


def graph_profile(engine, prompt: list[int], steps: int = 16) -> None:
    """Kernels of `steps` decode steps replayed as CUDA graphs, from the profiler's trace: time per
    step by kernel, and the idle time between consecutive kernels (under 5 µs: inside a replay;
    longer: the host's work between steps, stretched by the profiler itself)."""
    import collections

    from benchmarks.common import step_kernels
    from moestream.runtime.sampling import SamplingParams

    # the prefill and a few steps outside the trace
    events = step_kernels(engine, prompt, steps, 8, SamplingParams(max_tokens=steps + 16, ignore_eos=True))
    gaps = collections.Counter()
    for a, b in zip(events, events[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        gaps["inside replays (< 5 us)" if gap < 5 else "between steps"] += gap
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e["name"][:70]][0] += 1
        by_name[e["name"][:70]][1] += e["dur"]
    busy = sum(e["dur"] for e in events)
    print(f"graph replays: {len(events) / steps:.0f} kernels per step, {busy / steps:.1f} us of kernel time per step; "
          + ", ".join(f"gaps {k}: {v / steps:.1f} us" for k, v in gaps.items()))
    print(f"{'us/step':>9} {'count':>6} {'us each':>8}  kernel")
    for name, (count, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{dur / steps:9.1f} {count / steps:6.1f} {dur / count:8.2f}  {name}")


if __name__ == "__main__":
    main()
