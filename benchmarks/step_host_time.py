"""Host time of decode steps by part, with the engine's overlap off and on (`--overlap`): off, the
Python thread's path from reading a step's token to replaying the next step's graph leaves the device
idle; on, the next step is replayed before the token is read, so that path runs behind the device.

    python3 benchmarks/step_host_time.py CHECKPOINT [--capacity 32] [--miss-policy hybrid] [--routing uniform]
        [--steps 96] [--overlap off on]

Times `engine.step` and its parts with `time.perf_counter` (no profiler) over `--steps` decode steps
of one request (a 512-token prompt) at temperature 1, after 48 untimed ones, for each overlap mode in
turn (one process, one request each): the bank's `begin_step` (before the replay), the graph call, the
bank's `after_step` (after the replay), the read of the sampled token (`Engine._take`, the wait for
the device), the rest of `engine.step`, and the host's path from each token's read to the next replay
(with overlap on the replay comes first: the figure is then how long the read follows the replay).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402
from moestream.bench import apply_routing  # noqa: E402
from moestream.runtime.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--miss-policy", default="auto")
    ap.add_argument("--routing", choices=["model", "uniform"], default="uniform")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the same parts without graphs (a smoke run)")
    ap.add_argument("--overlap", nargs="+", default=["off", "on"], choices=["off", "on"],
                    help="the engine's overlap modes to time, in this order (default: off, then on)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    engine = moestream.load(args.model, device=args.device, dtype="bfloat16" if cuda else "float32",
                            capacity=args.capacity, host_tier="pinned" if args.capacity else "auto",
                            miss_policy=args.miss_policy, max_context=4096 if cuda else None)
    apply_routing(engine, args.routing)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, engine.config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
    for mode in args.overlap:
        engine.overlap = mode
        measure(engine, prompt, args.steps, cuda, f"overlap {mode}")
    engine.close()


def measure(engine, prompt: list[int], steps: int, cuda: bool, title: str) -> None:
    acc: dict[str, float] = defaultdict(float)
    last, gaps = [0.0], []   # when the last token was read; host time from each read to the next replay
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 64, ignore_eos=True, temperature=1.0))
    for _ in range(48):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    with contextlib.ExitStack() as patches:
        def timed(owner, name: str, key: str, then=None) -> None:
            fn = getattr(owner, name)

            def wrap(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    t1 = time.perf_counter()
                    acc[key] += t1 - t0
                    if then is not None:
                        then(t1)
            patches.enter_context(mock.patch.object(owner, name, wrap))

        def read_at(t: float) -> None:
            last[0] = t

        timed(engine.bank, "begin_step", "begin_step (before the replay)")
        timed(engine.bank, "after_step", "after_step (after the replay)")
        graphs = engine.runner._decoder(1)
        if graphs is not None:
            timed(type(graphs), "__call__", "graph call (inputs, replay)")
        timed(engine, "_take", "token read (waits for the device)", then=read_at)
        replay = torch.cuda.CUDAGraph.replay

        def timed_replay(self):
            if last[0]:
                gaps.append(time.perf_counter() - last[0])
                last[0] = 0.0
            return replay(self)
        patches.enter_context(mock.patch.object(torch.cuda.CUDAGraph, "replay", timed_replay))
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    while not engine.scheduler.idle:
        engine.step()
    gaps.sort()
    print(f"{title}: {total / steps * 1e3:.2f} ms per step; host from a token's read to the next replay: "
          f"{sum(gaps) / max(len(gaps), 1) * 1e6:.1f} us (median {gaps[len(gaps) // 2] * 1e6 if gaps else 0:.1f}, "
          f"{len(gaps)} of {steps} steps)")
    for key, value in acc.items():
        print(f"  {key:40s} {value / steps * 1e6:8.1f} us per step")
    print(f"  {'rest of engine.step':40s} {(total - sum(acc.values())) / steps * 1e6:8.1f} us per step")


if __name__ == "__main__":
    main()
