"""How fast each side of a batched hybrid step reads missed experts from host RAM: the GPU's decode
launches reading them in place over PCIe (per decode tile), the copy engine copying the same bytes
into device memory (the link's practical peak), the CPU kernel computing them from host RAM, and the
GPU and the CPU at once (they share the host's memory bandwidth).

    python benchmarks/host_read_bandwidth.py --out $OUT [--tokens 1 4 16] [--experts 128 --top-k 8]
        [--hidden 2048 --intermediate 768] [--sweep]

Routing is uniform: each token draws k distinct experts, all of them outside the bank, so every
routed expert is read from the pinned host stacks once per call whoever computes it; GB/s counts
each distinct expert's bytes once. With `--sweep`, the in-place read of the largest batch is timed for a grid
of decode tiles around the default (the one the batch path uses), to find a tile for host reads.
Results: `$OUT/host_read_bandwidth.json` and printed lines.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import log, write_result  # noqa: E402
from moestream.kernels import cpu_moe  # noqa: E402
from moestream.kernels.fused_moe_decode import (DEFAULT_DECODE_CONFIG, DecodeConfig, DecodeTile,  # noqa: E402
                                                HostOperand, launch_decode_gemms)
from moestream.kernels.fused_moe_token import host_offset  # noqa: E402


def uniform_routing(T: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(T, k) expert ids, k distinct per token, uniform."""
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])


def gpu_events_ms(fn, reps: int) -> float:
    """Mean ms of `fn` over `reps` calls after two warm ones (CUDA events; wall time off CUDA)."""
    fn()
    fn()
    if not torch.cuda.is_available():   # a smoke run (Triton's interpreter): figures meaningless
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


class Setup:
    """The bank (S slots on the device), the host stacks (every expert, pinned) and a call's buffers."""

    def __init__(self, args):
        H, I, E, S = args.hidden, args.intermediate, args.experts, args.slots
        self.H, self.I, self.E, self.S, self.k = H, I, E, S, args.top_k
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.bank_gate_up = torch.randn(S, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
        self.bank_down = torch.randn(S, H, I, device=dev, dtype=torch.bfloat16) * 0.02
        pin = (lambda t: t.pin_memory()) if dev.type == "cuda" else (lambda t: t)   # noqa: E731
        self.host_gate_up = pin(torch.randn(E, 2 * I, H, dtype=torch.bfloat16) * 0.02)
        self.host_down = pin(torch.randn(E, H, I, dtype=torch.bfloat16) * 0.02)
        self.host = (HostOperand(E, host_offset(self.host_gate_up, self.bank_gate_up)),
                     HostOperand(E, host_offset(self.host_down, self.bank_down)))
        self.expert_bytes = (2 * I * H + H * I) * 2

    def call(self, experts: torch.Tensor, config: DecodeConfig | None):
        """A closure: one batched decode MoE call reading every routed expert in place."""
        T, k = experts.shape
        dev = self.bank_gate_up.device
        hidden = torch.randn(T, self.H, device=dev, dtype=torch.bfloat16)
        slot_ids = (experts + self.S).to(torch.int32).to(dev)
        weights = torch.full((T, k), 1.0 / k, device=dev, dtype=torch.float32)
        inter = torch.empty(T * k, self.I, device=dev, dtype=torch.bfloat16)
        per_pair = torch.empty(T * k, self.H, device=dev, dtype=torch.float32)

        def run():
            launch_decode_gemms(hidden, self.bank_gate_up, self.bank_down, slot_ids, weights, inter, per_pair,
                                cpu_moe.ACTIVATION_CODES["swiglu"], config=config, host=self.host)
        return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    setup = Setup(args)
    gen = torch.Generator().manual_seed(0)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": []}

    def row(**fields):
        result["rows"].append(fields)
        log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()))

    for T in args.tokens:
        experts = uniform_routing(T, setup.E, setup.k, gen)
        distinct = experts.unique()
        nbytes = distinct.numel() * setup.expert_bytes
        ms = gpu_events_ms(setup.call(experts, None), args.reps)
        row(side="gpu in place", tokens=T, experts=distinct.numel(), ms=ms, gb_s=nbytes / ms / 1e6,
            tile=str(DEFAULT_DECODE_CONFIG))
        # the copy engine: the same experts' bytes into device memory, one copy per tensor per expert
        dst_gu = torch.empty(distinct.numel(), 2 * setup.I, setup.H, device=setup.bank_gate_up.device, dtype=torch.bfloat16)
        dst_d = torch.empty(distinct.numel(), setup.H, setup.I, device=setup.bank_gate_up.device, dtype=torch.bfloat16)

        def copies(ids=distinct.tolist()):
            for i, e in enumerate(ids):
                dst_gu[i].copy_(setup.host_gate_up[e], non_blocking=True)
                dst_d[i].copy_(setup.host_down[e], non_blocking=True)
        ms = gpu_events_ms(copies, args.reps)
        row(side="copy engine", tokens=T, experts=distinct.numel(), ms=ms, gb_s=nbytes / ms / 1e6)
        # the CPU kernel, all threads it would use
        hidden = torch.randn(T, setup.H, dtype=torch.bfloat16)
        stacks = {"gate_up": setup.host_gate_up, "down": setup.host_down}
        w = torch.full((T, setup.k), 1.0 / setup.k)
        cpu_moe.cpu_moe(hidden, stacks, experts, w)
        t0 = time.perf_counter()
        for _ in range(args.reps):
            cpu_moe.cpu_moe(hidden, stacks, experts, w)
        ms = (time.perf_counter() - t0) * 1e3 / args.reps
        row(side="cpu", tokens=T, experts=distinct.numel(), ms=ms, gb_s=nbytes / ms / 1e6,
            threads=cpu_moe.set_threads(None))
        # both at once on disjoint halves of the experts (as a split step is)
        half = distinct.numel() // 2
        gpu_part, cpu_part = distinct[:half], distinct[half:]
        gpu_ids = torch.where(torch.isin(experts, gpu_part), experts, torch.full_like(experts, -1 - setup.S))
        cpu_ids = torch.where(torch.isin(experts, cpu_part), experts, torch.full_like(experts, -1))
        gpu_call = setup.call(gpu_ids, None)
        stop = threading.Event()
        cpu_calls = [0]

        def cpu_loop():
            while not stop.is_set():
                cpu_moe.cpu_moe(hidden, stacks, cpu_ids, w)
                cpu_calls[0] += 1
        gpu_alone = gpu_events_ms(gpu_call, args.reps)
        thread = threading.Thread(target=cpu_loop)
        thread.start()
        time.sleep(0.2)
        calls0, t0 = cpu_calls[0], time.perf_counter()
        gpu_shared = gpu_events_ms(gpu_call, args.reps * 3)
        cpu_ms = (time.perf_counter() - t0) * 1e3 / max(1, cpu_calls[0] - calls0)
        stop.set()
        thread.join()
        row(side="gpu half, cpu busy", tokens=T, experts=half, ms=gpu_shared, alone_ms=gpu_alone,
            gb_s=half * setup.expert_bytes / gpu_shared / 1e6, cpu_ms=cpu_ms,
            cpu_gb_s=(distinct.numel() - half) * setup.expert_bytes / cpu_ms / 1e6)
        if args.sweep and T == max(args.tokens):
            call_of = lambda cfg: setup.call(experts, cfg)   # noqa: E731
            best = None
            for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 4, 6)):
                for which in ("gate_up", "down"):
                    base = DEFAULT_DECODE_CONFIG
                    tile = DecodeTile(bn, bk, warps, stages)
                    cfg = DecodeConfig(gate_up=tile, down=base.down) if which == "gate_up" else \
                        DecodeConfig(gate_up=base.gate_up, down=tile)
                    try:
                        ms = gpu_events_ms(call_of(cfg), args.reps)
                    except Exception as exc:   # a tile past the shared memory
                        log(f"skip {which} {tile}: {type(exc).__name__}")
                        continue
                    row(side=f"sweep {which}", tokens=T, ms=ms, gb_s=nbytes / ms / 1e6, tile=str(tile))
                    if which == "gate_up" and (best is None or ms < best[0]):
                        best = (ms, tile)
            log(f"best gate_up tile at T={T}: {best}")
    write_result(args.out, "host_read_bandwidth", result)


if __name__ == "__main__":
    main()
