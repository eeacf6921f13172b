"""Benchmark fused_moe (Triton) against moe_reference and a naive per-expert loop (CUDA).

Shape: Qwen3-30B-A3B's MoE layer (H=2048, I=768, E=S=128 slots, k=8), bf16, random routing
(k distinct slots per token). For each T it reports the median time (triton.testing.do_bench)
and:
  * GB/s  = bytes of the experts the batch touches (each used expert's gate_up + down, read
            once) / time: the figure of merit for decode, where the layer is a memory-bound GEMV;
  * TFLOP/s = 2 * T * k * 3 * H * I / time: the figure of merit for prefill.
`fused_moe (graph)` is the same call replayed from a CUDA graph (do_bench_cudagraph), which is
how the engine runs decode; the difference to `fused_moe` is launch overhead.

`--tune` also sweeps a few block-size candidates per T and prints the best, to refresh the
table in moestream/kernels/fused_moe.py.

Usage:
    python benchmarks/bench_fused_moe.py [--tokens 1 4 32 512 2048] [--json out.json] [--tune]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moestream.kernels import fused_moe, fused_moe_available, moe_reference  # noqa: E402


def naive_loop(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The transformers-style loop: for every slot, find its tokens and run its FFN."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    I = down.shape[2]
    for s in range(gate_up.shape[0]):
        tok, pos = torch.where(slot_ids == s)
        if tok.numel() == 0:                    # host sync per slot, as in transformers
            continue
        h = hidden[tok] @ gate_up[s].T
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        y = (act @ down[s].T).float() * weights[tok, pos, None]
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)


def make_layer(T: int, H: int, I: int, S: int, k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, device="cuda", dtype=torch.bfloat16)
    gate_up = (torch.randn(S, 2 * I, H, generator=g, device="cuda") / H ** 0.5).bfloat16()
    down = (torch.randn(S, H, I, generator=g, device="cuda") / I ** 0.5).bfloat16()
    slot_ids = torch.rand(T, S, generator=g, device="cuda").topk(k, dim=1).indices.int()
    weights = torch.rand(T, k, generator=g, device="cuda").softmax(dim=1)
    return hidden, gate_up, down, slot_ids, weights


def time_ms(fn: Callable[[], object], graph: bool = False) -> float:
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
    return float(triton.testing.do_bench(fn, return_mode="median"))


def tune(T: int, inputs, k: int, S: int) -> tuple[dict, float]:
    """Coordinate search around the default config for one T: BLOCK_M, the gate_up tile, the
    down tile, then GROUP_M (each timed on the whole call). Returns the best and its time.
    About 60 candidates, so budget ~1-2 minutes of compiling per T."""
    from dataclasses import asdict, replace

    from moestream.kernels.fused_moe import GemmConfig, fused_moe_with_config, select_config

    def measure(cfg) -> float:
        try:
            return time_ms(lambda: fused_moe_with_config(*inputs, config=cfg))
        except Exception as exc:  # out of shared memory / registers: not a candidate
            print(f"    skip {cfg}: {type(exc).__name__}")
            return float("inf")

    best = select_config(T, k, S)
    best_ms = measure(best)
    tiles = [GemmConfig(bn, bk, w, st) for bn, bk, w, st in itertools.product(
        (32, 64, 128, 256), (64, 128), (4, 8), (3, 4))]
    candidates = [lambda c, bm=bm: replace(c, block_m=bm) for bm in (16, 32, 64, 128)]
    candidates += [lambda c, g=g: replace(c, gate_up=g) for g in tiles if g.block_n <= 128]
    candidates += [lambda c, g=g: replace(c, down=g) for g in tiles]
    candidates += [lambda c, gm=gm: replace(c, gate_up=replace(c.gate_up, group_m=gm),
                                            down=replace(c.down, group_m=gm)) for gm in (1, 8)]
    for make in candidates:
        cfg = make(best)
        ms = measure(cfg)
        if ms < best_ms:
            best, best_ms = cfg, ms
    return asdict(best), best_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32, 512, 2048])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--tune", action="store_true", help="sweep block sizes per T")
    parser.add_argument("--skip-naive-above", type=int, default=1 << 30,
                        help="skip the naive loop for T above this (default: never)")
    args = parser.parse_args()
    if not fused_moe_available():
        sys.exit("bench_fused_moe needs a CUDA device and Triton")

    H, I, S, k = args.hidden, args.intermediate, args.slots, args.top_k
    expert_bytes = 3 * H * I * 2                                     # gate, up, down in bf16
    rows: list[dict] = []
    tuned: dict[int, dict] = {}
    for T in args.tokens:
        inputs = make_layer(T, H, I, S, k, seed=T)
        used = int(inputs[3].unique().numel())
        bytes_touched = used * expert_bytes + T * H * 2 * 2
        flops = 2 * T * k * 3 * H * I
        ref32 = moe_reference(*(t.float() if t.is_floating_point() else t for t in inputs))
        err = float((fused_moe(*inputs).float() - ref32).norm() / ref32.norm())
        impls: list[tuple[str, Callable[[], object], bool]] = [
            ("fused_moe", lambda: fused_moe(*inputs), False),
            ("fused_moe (graph)", lambda: fused_moe(*inputs), True),
            ("moe_reference", lambda: moe_reference(*inputs), False),
        ]
        if T <= args.skip_naive_above:
            impls.append(("naive_loop", lambda: naive_loop(*inputs), False))
        for name, fn, graph in impls:
            ms = time_ms(fn, graph=graph)
            rows.append({"T": T, "impl": name, "ms": ms, "experts_touched": used,
                         "GB_per_s": bytes_touched / ms / 1e6, "TFLOP_per_s": flops / ms / 1e9,
                         "rel_err_vs_fp32": err if name.startswith("fused") else None})
        if args.tune:
            cfg, ms = tune(T, inputs, k, S)
            tuned[T] = {"config": cfg, "ms": ms}
            print(f"T={T}: best {cfg} {ms * 1e3:.1f} us")

    print(f"\nfused MoE, H={H} I={I} S={S} k={k} bf16 on {torch.cuda.get_device_name()}")
    print(f"{'T':>6} {'impl':<18} {'experts':>7} {'time us':>10} {'GB/s':>8} {'TFLOP/s':>8}"
          f" {'rel err':>9}")
    for r in rows:
        err = f"{r['rel_err_vs_fp32']:.1e}" if r["rel_err_vs_fp32"] is not None else ""
        print(f"{r['T']:>6} {r['impl']:<18} {r['experts_touched']:>7} {r['ms'] * 1e3:>10.1f} "
              f"{r['GB_per_s']:>8.0f} {r['TFLOP_per_s']:>8.1f} {err:>9}")

    if args.json:
        import triton

        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "python": platform.python_version(),
                "shape": {"H": H, "I": I, "S": S, "k": k, "dtype": "bfloat16"},
                "command": " ".join(sys.argv)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": rows,
                                         "tuned": tuned}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
