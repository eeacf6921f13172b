"""Benchmark fused_moe's two paths (Triton) against moe_reference and a naive loop (CUDA).

Shape: Qwen3-30B-A3B's MoE layer (H=2048, I=768, E=S=128 slots, k=8), bf16, random routing
(k distinct slots per token). For each T, both paths of `fused_moe_with_config` are forced
(`path="decode"`: no align, 3 launches; `path="grouped"`: align + grouped GEMMs, 4 launches),
so the crossover for `DECODE_MAX_PAIRS` can be read off one run. Each is timed three ways:

* `eager`  — triton.testing.do_bench (L2 flushed before each call; host launch cost included
             when it exceeds the GPU time);
* `graph`  — triton.testing.do_bench_cudagraph on the same inputs every replay (the same
             experts each time: partly served from the 50 MB L2 when they fit);
* `cold`   — one CUDA graph holding the call on 16 different random routings in a row, the
             way decode walks through layers: each call finds its experts in HBM. This is the
             number to compare with the HBM roofline.

Columns: GB/s = bytes of the experts the batch touches (each used expert's gate_up + down,
read once) / time, the figure of merit for decode; TFLOP/s = 2 * T * k * 3 * H * I / time, the
figure of merit for prefill; `roof us` = those bytes at 3.35 TB/s (H100 SXM HBM3 peak).

`--tune` sweeps grouped-path block sizes per T (refreshes `_CONFIG_TABLE`); `--tune-decode`
sweeps decode tiles at T=1 and T=8 (refreshes `DEFAULT_DECODE_CONFIG`), timed `cold`;
`--tune-token` sweeps the one-token path's tiles (refreshes `DEFAULT_TOKEN_CONFIG`) beside the
decode path at T=1. At T=1 the "token" rows are the one-token path, which `fused_moe` takes there.

`--format int4` (any quantization name, or an FP8 one: fp8-b128x128, fp8-channel) times the dequantizing kernel (`fused_moe_quant`) beside
the bf16 one, `cold`, per T: GB/s counts the packed bytes, scales and biases of the experts touched;
at T=1 also the decode path (`decode_path_us`) beside the one-token path auto takes; for the grouped path's
sizes also every slot dequantized into bf16 first, then the bf16 grouped GEMMs (`dequant_path_us`), and that
dequantizing alone (`dequantize_alone_us`). With
`--tune-token` it first sweeps the quantized one-token tiles (refreshes `QUANT_TOKEN_CONFIG`); with
`--tune`, the grouped path's tiles at each T of the grouped path (refreshes `_QUANT_CONFIG_TABLE`).

Usage:
    python benchmarks/fused_moe_kernel.py [--tokens 1 2 4 8 16 32 512 2048] [--json out.json]
                                         [--tune] [--tune-decode] [--tune-token] [--format int4]
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

from moestream.kernels import fused_moe_available, moe_reference  # noqa: E402

HBM_PEAK_BYTES_PER_S = 3.35e12
COLD_ROUTINGS = 16


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


def make_bank(H: int, I: int, S: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(S, 2 * I, H, generator=g, device="cuda") / H ** 0.5).bfloat16()
    down = (torch.randn(S, H, I, generator=g, device="cuda") / I ** 0.5).bfloat16()
    return gate_up, down


def make_routing(T: int, H: int, S: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, device="cuda", dtype=torch.bfloat16)
    slot_ids = torch.rand(T, S, generator=g, device="cuda").topk(k, dim=1).indices.int()
    weights = torch.rand(T, k, generator=g, device="cuda").softmax(dim=1)
    return hidden, slot_ids, weights


def time_ms(fn: Callable[[], object], graph: bool = False) -> float:
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
    return float(triton.testing.do_bench(fn, return_mode="median"))


def time_cold_graph_ms(call: Callable[[tuple], object], routings: list[tuple],
                       replays: int = 10) -> float:
    """Median time per call of one graph that runs `call` on every routing in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for r in routings:                       # compile and warm up outside the capture
            call(r)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for r in routings:
                call(r)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(routings))
    del graph
    return sorted(times)[len(times) // 2]


def skipping(time_of: Callable[[object], float]) -> Callable[[object], float]:
    """`time_of(cfg)`, or infinity for a config that cannot run (out of shared memory or registers)."""
    def measure(cfg) -> float:
        try:
            return time_of(cfg)
        except Exception as exc:
            print(f"    skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
            return float("inf")
    return measure


def coordinate_search(start, measure: Callable[[object], float],
                      variants: list[Callable[[object], object]]) -> tuple[object, float, float]:
    """Each variant (config -> config) applied in turn to the best config so far, kept when faster.
    Returns (best, its time, the start's time)."""
    best = start
    best_ms = start_ms = measure(start)
    for make in variants:
        cfg = make(best)
        ms = measure(cfg)
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, start_ms


def tune(T: int, inputs, k: int, S: int) -> tuple[dict, float]:
    """Coordinate search around the default grouped config for one T: BLOCK_M, the gate_up
    tile, the down tile, then GROUP_M (each timed on the whole call). Returns the best and its
    time. About 60 candidates, so budget ~1-2 minutes of compiling per T."""
    from dataclasses import asdict, replace

    from moestream.kernels.fused_moe_triton import (
        GemmConfig,
        fused_moe_with_config,
        select_config,
    )

    measure = skipping(lambda cfg: time_ms(lambda: fused_moe_with_config(*inputs, config=cfg, path="grouped")))
    tiles = [GemmConfig(bn, bk, w, st) for bn, bk, w, st in itertools.product(
        (32, 64, 128, 256), (64, 128), (4, 8), (3, 4))]
    candidates = [lambda c, bm=bm: replace(c, block_m=bm) for bm in (16, 32, 64, 128)]
    candidates += [lambda c, g=g: replace(c, gate_up=g) for g in tiles if g.block_n <= 128]
    candidates += [lambda c, g=g: replace(c, down=g) for g in tiles]
    candidates += [lambda c, gm=gm: replace(c, gate_up=replace(c.gate_up, group_m=gm),
                                            down=replace(c.down, group_m=gm)) for gm in (1, 8)]
    best, best_ms, _ = coordinate_search(select_config(T, k, S), measure, candidates)
    return asdict(best), best_ms


def tune_quant(T: int, qbank, spec, routing: tuple, k: int, S: int) -> tuple[dict, float, float]:
    """`tune` for the dequantizing grouped path (refreshes `_QUANT_CONFIG_TABLE`): the same coordinate
    search with BLOCK_K up to 256 and 2-3 stages, each candidate's output checked against the start
    config's (a tile that computes something else is refused). Returns (best, its time, the start's)."""
    from dataclasses import asdict, replace

    from moestream.kernels.fused_moe_quant_triton import fused_moe_quant
    from moestream.kernels.fused_moe_triton import GemmConfig, select_config

    hidden, slot_ids, weights = routing
    start = select_config(T, k, S, quantized=True)
    want = fused_moe_quant(hidden, qbank, slot_ids, weights, spec, config=start, path="grouped").float()

    def time_of(cfg) -> float:
        out = fused_moe_quant(hidden, qbank, slot_ids, weights, spec, config=cfg, path="grouped").float()
        if (out - want).norm() > 1e-3 * want.norm():
            raise ValueError("output differs from the start config's")
        return time_ms(lambda: fused_moe_quant(hidden, qbank, slot_ids, weights, spec, config=cfg, path="grouped"))

    measure = skipping(time_of)
    tiles = [GemmConfig(bn, bk, w, st) for bn, bk, w, st in itertools.product(
        (64, 128), (64, 128, 256), (4, 8), (2, 3))]
    candidates = [lambda c, bm=bm: replace(c, block_m=bm) for bm in (16, 32, 64, 128)]
    candidates += [lambda c, g=g: replace(c, gate_up=replace(g, group_m=c.gate_up.group_m)) for g in tiles]
    candidates += [lambda c, g=g: replace(c, down=replace(g, group_m=c.down.group_m)) for g in tiles]
    candidates += [lambda c, gm=gm: replace(c, gate_up=replace(c.gate_up, group_m=gm),
                                            down=replace(c.down, group_m=gm)) for gm in (1, 8)]
    best, best_ms, start_ms = coordinate_search(start, measure, candidates)
    print(f"T={T}: quantized grouped start {start} {start_ms * 1e3:.1f} us -> best {best} {best_ms * 1e3:.1f} us")
    return asdict(best), best_ms, start_ms


def tune_decode(T: int, bank, routings: list[tuple]) -> tuple[dict, float]:
    """Coordinate search around DEFAULT_DECODE_CONFIG: the gate_up tile, then the down tile,
    each timed `cold` on the whole call. 13 candidates, about a second of compiling each."""
    from dataclasses import asdict, replace

    from moestream.kernels.fused_moe_triton import (
        DEFAULT_DECODE_CONFIG,
        DecodeTile,
        fused_moe_with_config,
    )

    measure = skipping(lambda cfg: time_cold_graph_ms(
        lambda r: fused_moe_with_config(r[0], *bank, r[1], r[2], config=cfg, path="decode"), routings, replays=5))
    gate_up_tiles = [DecodeTile(bn, bk, w, st) for bn, bk, w, st in (
        (16, 64, 4, 6), (16, 128, 4, 3), (16, 256, 4, 3), (32, 128, 4, 4), (16, 128, 2, 4),
        (32, 256, 8, 3))]
    down_tiles = [DecodeTile(bn, bk, w, st) for bn, bk, w, st in (
        (16, 128, 4, 4), (32, 64, 4, 6), (32, 256, 4, 3), (64, 128, 4, 4), (32, 128, 2, 4),
        (128, 64, 4, 4))]
    variants = [lambda c, t=t: replace(c, gate_up=t) for t in gate_up_tiles]
    variants += [lambda c, t=t: replace(c, down=t) for t in down_tiles]
    best, best_ms, _ = coordinate_search(DEFAULT_DECODE_CONFIG, measure, variants)
    print(f"T={T}: best decode {best} {best_ms * 1e3:.1f} us (cold)")
    return asdict(best), best_ms


def tune_token(bank, routings: list[tuple]) -> tuple[dict, float, float]:
    """Coordinate search over the one-token path's tiles (T = 1): the gate_up tile, then the down
    tile, each timed `cold` on the whole call. Returns (best config, its time, the decode path's)."""
    from dataclasses import asdict, replace

    from moestream.kernels.fused_moe_token import DEFAULT_TOKEN_CONFIG, TokenTile
    from moestream.kernels.fused_moe_triton import DEFAULT_DECODE_CONFIG, fused_moe_with_config

    measure = skipping(lambda cfg: time_cold_graph_ms(
        lambda r: fused_moe_with_config(r[0], *bank, r[1], r[2], config=cfg), routings, replays=5))
    decode_ms = time_cold_graph_ms(lambda r: fused_moe_with_config(r[0], *bank, r[1], r[2],
                                                                   config=DEFAULT_DECODE_CONFIG), routings)
    variants = [lambda c, t=TokenTile(bn, bk, w): replace(c, gate_up=t)
                for bn, bk, w in itertools.product((2, 4), (512, 1024, 2048), (4, 8))]
    variants += [lambda c, t=TokenTile(bn, bk, w): replace(c, down=t)
                 for bn, bk, w in itertools.product((2, 4, 8), (64, 128, 256), (2, 4, 8))]
    best, best_ms, default_ms = coordinate_search(DEFAULT_TOKEN_CONFIG, measure, variants)
    print(f"T=1: best token {best} {best_ms * 1e3:.1f} us (cold; default {default_ms * 1e3:.1f} us), "
          f"decode path {decode_ms * 1e3:.1f} us", flush=True)
    return asdict(best), best_ms, decode_ms


def tune_token_quant(qbank: dict, spec, routings: list[tuple]) -> tuple[dict, float, float]:
    """`tune_token` for quantized experts (fused_moe_token_quant.py): returns (best config, its time,
    the decode path's), each timed cold on the whole call."""
    from dataclasses import asdict, replace

    from moestream.kernels.fused_moe_quant_triton import fused_moe_quant
    from moestream.kernels.fused_moe_token import TokenTile
    from moestream.kernels.fused_moe_token_quant import QUANT_TOKEN_CONFIG

    measure = skipping(lambda cfg: time_cold_graph_ms(
        lambda r: fused_moe_quant(r[0], qbank, r[1], r[2], spec, config=cfg), routings, replays=5))
    decode_ms = time_cold_graph_ms(lambda r: fused_moe_quant(r[0], qbank, r[1], r[2], spec, path="decode"), routings)
    variants = [lambda c, t=TokenTile(bn, bk, w): replace(c, gate_up=t)
                for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8))]
    variants += [lambda c, t=TokenTile(bn, bk, w): replace(c, down=t)
                 for bn, bk, w in itertools.product((1, 2, 4, 8), (128, 256, 512), (2, 4, 8))]
    best, best_ms, default_ms = coordinate_search(QUANT_TOKEN_CONFIG, measure, variants)
    print(f"T=1 {spec.name}: best token {best} {best_ms * 1e3:.1f} us (cold; default {default_ms * 1e3:.1f} us), "
          f"decode path {decode_ms * 1e3:.1f} us", flush=True)
    return asdict(best), best_ms, decode_ms


def quant_rows(args) -> None:
    """The dequantizing kernel against bf16 at each T, cold (16 routings per graph); at T = 1 also the
    decode path the one-token path replaced (`--tune-token`: sweep the one-token tiles first)."""
    from moestream.kernels.fused_moe_triton import fused_moe_with_config
    from moestream.kernels.fused_moe_quant_triton import fused_moe_quant
    from moestream.quant import parse_quant, quantize
    from moestream.quant.fp8 import parse_fp8

    from moestream.kernels.dequant_slots_triton import dequantize_operand
    from moestream.kernels.fused_moe_quant_triton import quant_operand

    spec = parse_fp8(args.format) or parse_quant(args.format)
    H, I, S, k = args.hidden, args.intermediate, args.slots, args.top_k
    bank = make_bank(H, I, S)
    if spec.kind == "fp8":   # FP8 e4m3 slots as an FP8 checkpoint's experts fill them (fp8-b128x128, fp8-channel)
        from moestream.experts.format import ExpertShape, Fp8Format

        fmt = Fp8Format(spec, bank[0].dtype)
        qbank = fmt.empty(ExpertShape(H, I), S, device=bank[0].device)
        for s in range(S):
            fmt.encode(bank[0][s][:I], bank[0][s][I:], bank[1][s], {name: t[s] for name, t in qbank.items()})
    else:
        slots: dict[str, list] = {}
        for proj, t in (("gate_up", bank[0]), ("down", bank[1])):
            for s in range(S):
                for part, v in quantize(t[s], spec).parts().items():
                    slots.setdefault(f"{proj}.{part}", []).append(v)
        qbank = {name: torch.stack(v) for name, v in slots.items()}
    q_expert = sum(t[0].numel() * t.element_size() for t in qbank.values())
    print(f"{spec.name}: {q_expert / 1e6:.2f} MB per expert (bf16 {3 * H * I * 2 / 1e6:.2f} MB)")
    rows = []
    if args.tune_token:
        routings = [make_routing(1, H, S, k, seed=1000 + i) for i in range(COLD_ROUTINGS)]
        cfg, ms, decode_ms = tune_token_quant(qbank, spec, routings)
        rows.append({"T": 1, "format": spec.name, "tuned_token": cfg, "token_us": ms * 1e3, "decode_us": decode_ms * 1e3})
    for T in args.tokens:
        if args.tune and T * k > 64:   # the grouped path's sizes (smaller calls take the decode path)
            cfg, ms, start_ms = tune_quant(T, qbank, spec, make_routing(T, H, S, k, seed=T), k, S)
            rows.append({"T": T, "format": spec.name, "tuned_grouped": cfg, "grouped_us": ms * 1e3,
                         "start_us": start_ms * 1e3})
            print(json.dumps(rows[-1]), flush=True)
        cold = [make_routing(T, H, S, k, seed=1000 * T + i) for i in range(COLD_ROUTINGS)]
        used = sum(int(r[1].unique().numel()) for r in cold) / len(cold)
        bf = time_cold_graph_ms(lambda r: fused_moe_with_config(r[0], *bank, r[1], r[2]), cold)
        q = time_cold_graph_ms(lambda r: fused_moe_quant(r[0], qbank, r[1], r[2], spec), cold)
        err = float((fused_moe_quant(*cold[0][:1], qbank, *cold[0][1:], spec).float()
                     - fused_moe_with_config(cold[0][0], *bank, cold[0][1], cold[0][2]).float()).norm()
                    / fused_moe_with_config(cold[0][0], *bank, cold[0][1], cold[0][2]).float().norm())
        rows.append({"T": T, "format": spec.name, "bf16_us": bf * 1e3, "quant_us": q * 1e3,
                     "quant_GB_per_s": used * q_expert / q / 1e6, "bf16_GB_per_s": used * 3 * H * I * 2 / bf / 1e6,
                     "rel_diff_vs_bf16": err})
        if T * k > 64:   # every slot dequantized once, then the bf16 grouped GEMMs (and the dequantizing alone)
            dq = time_cold_graph_ms(lambda r: fused_moe_quant(r[0], qbank, r[1], r[2], spec, path="dequant"), cold)
            ops = [quant_operand(qbank, "gate_up", spec), quant_operand(qbank, "down", spec)]
            alone = time_cold_graph_ms(lambda r: (dequantize_operand(ops[0], H, r[0].dtype, True),
                                                  dequantize_operand(ops[1], I, r[0].dtype, False)), cold)
            rows[-1].update(dequant_path_us=dq * 1e3, dequantize_alone_us=alone * 1e3)
        if T == 1:   # the path T = 1 took before the one-token kernels, where the format has them
            dq = time_cold_graph_ms(lambda r: fused_moe_quant(r[0], qbank, r[1], r[2], spec, path="decode"), cold)
            rows[-1].update(decode_path_us=dq * 1e3, decode_path_GB_per_s=used * q_expert / dq / 1e6)
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 512, 2048])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--decode-max-tokens", type=int, default=32,
                        help="time the decode path only up to this T (default 32)")
    parser.add_argument("--peers-max-tokens", type=int, default=1 << 30,
                        help="time moe_reference and the naive loop only up to this T")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--tune", action="store_true", help="sweep grouped block sizes per T")
    parser.add_argument("--tune-decode", action="store_true",
                        help="sweep decode tiles at T=1 and T=8 (cold graph timing)")
    parser.add_argument("--tune-token", action="store_true",
                        help="sweep the one-token path's tiles (T=1, cold graph timing) and stop; with --format, "
                             "the quantized one-token tiles, then the format's rows")
    parser.add_argument("--format", default=None, help="also time quantized experts in this format (e.g. int4)")
    args = parser.parse_args()
    if not fused_moe_available():
        sys.exit("fused_moe_kernel.py needs a CUDA device and Triton")
    if args.format:
        quant_rows(args)
        return
    if args.tune_token:
        bank = make_bank(args.hidden, args.intermediate, args.slots)
        routings = [make_routing(1, args.hidden, args.slots, args.top_k, seed=1000 + i) for i in range(COLD_ROUTINGS)]
        cfg, ms, decode_ms = tune_token(bank, routings)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "token": cfg, "token_us": ms * 1e3,
                                             "decode_us": decode_ms * 1e3}, indent=2))
        return
    from moestream.kernels.fused_moe_triton import DECODE_MAX_PAIRS, fused_moe_with_config

    H, I, S, k = args.hidden, args.intermediate, args.slots, args.top_k
    expert_bytes = 3 * H * I * 2                                     # gate, up, down in bf16
    bank = make_bank(H, I, S)
    rows: list[dict] = []
    tuned: dict[str, dict] = {}
    for T in args.tokens:
        hidden, slot_ids, weights = make_routing(T, H, S, k, seed=T)
        inputs = (hidden, *bank, slot_ids, weights)
        used = int(slot_ids.unique().numel())
        bytes_touched = used * expert_bytes + T * H * 2 * 2
        cold = [make_routing(T, H, S, k, seed=1000 * T + i) for i in range(COLD_ROUTINGS)]
        cold_used = sum(int(r[1].unique().numel()) for r in cold) / len(cold)
        cold_bytes = cold_used * expert_bytes + T * H * 2 * 2
        flops = 2 * T * k * 3 * H * I
        ref32 = moe_reference(*(t.float() if t.is_floating_point() else t for t in inputs))
        paths = ["grouped"] + (["decode"] if T <= args.decode_max_tokens else []) + (["token"] if T == 1 else [])
        impls: list[tuple[str, str, Callable[[], object], float | None]] = []
        for path in paths:
            def call(p=path, x=inputs):
                return fused_moe_with_config(*x, path=p)
            out = call()
            err = float((out.float() - ref32).norm() / ref32.norm())
            impls.append((path, "eager", call, err))
            impls.append((path, "graph", call, err))
            impls.append((path, "cold", call, err))
        if T <= args.peers_max_tokens:
            impls.append(("moe_reference", "eager", lambda x=inputs: moe_reference(*x), None))
            impls.append(("naive_loop", "eager", lambda x=inputs: naive_loop(*x), None))
        for name, mode, fn, err in impls:
            if mode == "cold":
                ms = time_cold_graph_ms(
                    lambda r, p=name: fused_moe_with_config(r[0], *bank, r[1], r[2], path=p),
                    cold)
                nbytes, n_used = cold_bytes, cold_used
            else:
                ms = time_ms(fn, graph=(mode == "graph"))
                nbytes, n_used = bytes_touched, used
            rows.append({"T": T, "impl": name, "mode": mode, "ms": ms, "experts_touched": n_used,
                         "GB_per_s": nbytes / ms / 1e6, "TFLOP_per_s": flops / ms / 1e9,
                         "roofline_ms": nbytes / HBM_PEAK_BYTES_PER_S * 1e3,
                         "rel_err_vs_fp32": err})
            print(f"  T={T} {name} {mode}: {ms * 1e3:.1f} us", flush=True)
        if args.tune:
            cfg, ms = tune(T, inputs, k, S)
            tuned[f"grouped T={T}"] = {"config": cfg, "ms": ms}
            print(f"T={T}: best grouped {cfg} {ms * 1e3:.1f} us")
        if args.tune_decode and T in (1, 8):
            cfg, ms = tune_decode(T, bank, cold)
            tuned[f"decode T={T}"] = {"config": cfg, "ms": ms}

    print(f"\nfused MoE, H={H} I={I} S={S} k={k} bf16 on {torch.cuda.get_device_name()}; "
          f"auto path: decode when T*k <= {DECODE_MAX_PAIRS}")
    print(f"{'T':>6} {'impl':<14} {'mode':<6} {'experts':>7} {'time us':>9} {'roof us':>8} "
          f"{'GB/s':>7} {'TFLOP/s':>8} {'rel err':>8}")
    for r in rows:
        err = f"{r['rel_err_vs_fp32']:.1e}" if r["rel_err_vs_fp32"] is not None else ""
        print(f"{r['T']:>6} {r['impl']:<14} {r['mode']:<6} {r['experts_touched']:>7.1f} "
              f"{r['ms'] * 1e3:>9.1f} {r['roofline_ms'] * 1e3:>8.1f} {r['GB_per_s']:>7.0f} "
              f"{r['TFLOP_per_s']:>8.1f} {err:>8}")
    for name, t in tuned.items():
        print(f"tuned {name}: {t['ms'] * 1e3:.1f} us {t['config']}")

    if args.json:
        import triton

        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "python": platform.python_version(),
                "shape": {"H": H, "I": I, "S": S, "k": k, "dtype": "bfloat16"},
                "decode_max_pairs": DECODE_MAX_PAIRS, "command": " ".join(sys.argv)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": rows,
                                         "tuned": tuned}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
