"""Device time of one decode step's sampling at batch 1 over a real vocabulary: `sampling.sample` against
filtering the whole row first (`filter_logits`, then a draw: what `sample` does without top-k), and
against its top-k draw in torch launches (`draw_kernel(False)`: what a CPU, or a row the two-launch
kernel does not take, gets).

    python3 benchmarks/sampling_time.py [--vocab 151936] [--calls 200] [--device cuda]

Each setting runs `--calls` draws from one bf16 logits row queued behind a GPU sleep, so the launches
are all queued before the device reaches them: the time between two events around them is the
device's own (with overlapped decode the host's launch time runs behind the step in flight). The
settings are the ones model cards recommend (Qwen3: temperature 0.7, top-p 0.8, top-k 20; thinking
0.6, 0.95, 20), plain temperature, top-p alone, and greedy. On a CPU the loop is timed by the clock
(a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.runtime.sampling import SamplingParams, draw_kernel, filter_logits, make_generator, sample  # noqa: E402

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "T 0.7, top-p 0.8, top-k 20": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "T 0.6, top-p 0.95, top-k 20": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    "T 0.8, top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "T 0.7, top-k 40, min-p 0.05": {"temperature": 0.7, "top_k": 40, "min_p": 0.05},
}


def whole_row(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(filter_logits(logits, params).softmax(-1), 1, generator=generator).squeeze(-1)


def device_us(fn, calls: int, cuda: bool) -> float:
    """Microseconds per call of `fn()`, on the device's clock when there is one."""
    fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)   # ~0.1 s: every launch below is queued before the device gets to it
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(1, args.vocab, generator=gen, device=device) * 3).to(torch.bfloat16 if cuda else torch.float32)
    print(f"{'setting':32s} {'whole row':>10s} {'torch':>10s} {'sample':>10s}   us per call "
          f"({'device' if cuda else 'host'} time); whole row / sample")
    for name, kw in SETTINGS.items():
        params = SamplingParams(**kw)
        params.validate()
        g = make_generator(SamplingParams(**kw, seed=1), device)
        old = device_us(lambda p=params, g=g: whole_row(logits, p, g), args.calls, cuda)
        with draw_kernel(False):
            torch_draw = device_us(lambda p=params, g=g: sample(logits, p, g), args.calls, cuda)
        new = device_us(lambda p=params, g=g: sample(logits, p, g), args.calls, cuda)
        print(f"{name:32s} {old:10.1f} {torch_draw:10.1f} {new:10.1f}   {old / new:.2f}x")


if __name__ == "__main__":
    main()
