"""Where a batch-1 decode step's time goes on one GPU and on two (expert parallel): rank 0's kernels
over a run of replayed decode steps, summed by name, and the step time beside them.

    python benchmarks/expert_parallel_profile.py --ckpt /tmp/q24 --out /tmp/epprof

Each configuration loads its own engine under uniform routing (k distinct experts drawn per token),
decodes a 64-token prompt, times `--steps` decode steps as the difference of two runs that differ only
in their token count (so prefill and start-up cancel), then profiles `--steps` decode steps
(`common.step_kernels`: kernels inside graph replays are listed) and sums them by name. The kernels
a second GPU adds, or makes cheaper, show as rows that differ between the two tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moestream  # noqa: E402
from benchmarks.common import log, step_kernels, write_result  # noqa: E402
from benchmarks.expert_parallel_decode import release, visible  # noqa: E402
from moestream.bench import apply_routing  # noqa: E402
from moestream.runtime.sampling import SamplingParams  # noqa: E402


def measure(ckpt: str, world: int, steps: int, top: int) -> dict:
    kwargs = dict(device="cuda:0") if world == 1 else dict(devices=[f"cuda:{i}" for i in range(world)])
    engine = moestream.load(ckpt, dtype="bfloat16", max_batch=1, kv_rows=1, **kwargs)
    try:
        apply_routing(engine, "uniform")
        prompt = torch.randint(0, engine.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        lead = 8

        def run(n: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompt, max_tokens=n, ignore_eos=True, temperature=1.0, seed=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        run(lead + steps)   # compiles, captures the graphs
        step_ms = (run(lead + steps) - run(lead)) / steps * 1e3
        params = SamplingParams(max_tokens=lead + steps + 8, ignore_eos=True, temperature=1.0, seed=0)
        kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for event in step_kernels(engine, prompt, steps, lead, params):
            kernels[event["name"][:80]][0] += 1
            kernels[event["name"][:80]][1] += event["dur"] / 1e3   # ms
        rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        return dict(gpus=world, routing="uniform (synthetic)", step_ms=step_ms, profiled_steps=steps,
                    kernel_launches=sum(c for c, _ in kernels.values()),
                    kernels=[dict(name=name, calls=int(c), ms=round(ms, 3)) for name, (c, ms) in rows[:top]])
    finally:
        engine.close()
        release(engine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed (default 32)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per configuration (default 25)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in visible(args.devices):
        row = measure(args.ckpt, world, args.steps, args.top)
        log(json.dumps({k: v for k, v in row.items() if k != "kernels"}))
        for kernel in row["kernels"]:
            log(f"  {kernel['calls']:6d} {kernel['ms']:9.3f} ms  {kernel['name']}")
        rows.append(row)
        write_result(out, "expert_parallel_profile", {"rows": rows})


if __name__ == "__main__":
    main()
