"""What one missed expert costs each way: computed on the CPU from host RAM (the C kernel, and torch's
reference), or copied over PCIe into a device slot.

    python benchmarks/cpu_experts.py --out $OUT [--hidden 2048 --intermediate 768] [--threads 1 4 8 15 16]
        [--experts-per-call 1 3 6] [--tokens 1 4 16] [--formats bf16 int4-g64 int8-g64 int4-g32:fp16 nf4 fp8-b128x128 mxfp4]
        [--int4-path fp32]
        [--prefetch 0 512 2048 --rounds 5]

The experts live in one stacked host tensor of `--pool` experts (default 256: several hundred MB,
far beyond the last-level cache, so every call reads DRAM, as a real miss does) and each timed
call takes the next ones in turn. With `--prefetch`, each setting's kernel time is taken for every
prefetch distance in turn, `--rounds` times over (interleaved: the host drifts between runs), and the
median of each is reported. Results: `$OUT/cpu_experts.json` and a printed table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.kernels import cpu_moe  # noqa: E402
from moestream.kernels.moe_reference import moe_reference  # noqa: E402
from moestream.kernels.quant_moe_reference import quant_moe_reference  # noqa: E402
from moestream.quant import parse_quant, quantize  # noqa: E402
from moestream.quant.fp8 import parse_fp8  # noqa: E402
from moestream.quant.mxfp4 import MXFP4  # noqa: E402


def timed(fn, calls: int) -> float:
    fn(0)
    t0 = time.perf_counter()
    for i in range(1, calls + 1):
        fn(i)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=None)
    ap.add_argument("--experts-per-call", type=int, nargs="+", default=[1, 3, 6])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--formats", nargs="+", default=["bf16"],
                    help="expert formats: bf16, or quantized ones (int4-g64, nf4, fp8-b128x128, fp8-channel, mxfp4, "
                         "...: the bf16 pool quantized)")
    ap.add_argument("--int4-path", choices=["bf16", "fp32"], default="bf16",
                    help="affine 4-bit experts with bf16 inputs: the bf16 dot products (default) or the fp32 path")
    ap.add_argument("--prefetch", type=int, nargs="+", default=None, metavar="BYTES",
                    help="prefetch distances of the kernel's weight reads to compare (0: none; default: the kernel's own)")
    ap.add_argument("--rounds", type=int, default=5, help="with --prefetch: interleaved rounds per distance")
    ap.add_argument("--memory", nargs="+", choices=["pinned", "huge"], default=["pinned"],
                    help="host memory of the pool: pinned by cudaHostAlloc (4 KiB pages), or anonymous memory "
                         "advised into transparent huge pages, then registered with CUDA")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    H, I, P = args.hidden, args.intermediate, args.pool
    cuda = torch.cuda.is_available()
    gen = torch.Generator().manual_seed(0)
    source = {"gate_up": torch.randn(P, 2 * I, H, generator=gen).to(torch.bfloat16),
              "down": torch.randn(P, H, I, generator=gen).to(torch.bfloat16)}
    result = {}
    if args.int4_path == "fp32":   # the kernel's fp32 path for every quantized call (before the bf16 one)
        cpu_moe._q4_bf16 = lambda *a: False
    for fmt in args.formats:
        pool = source if fmt == "bf16" else _quantized(source, _spec(fmt), cuda)
        kernel, reference = _paths(fmt)
        expert_bytes = sum(t[0].nbytes for t in pool.values())
        for memory in args.memory:
            stack = {n: _host(t, memory, cuda) for n, t in pool.items()}
            print(f"--- {fmt} experts ({expert_bytes / 1e6:.2f} MB each), memory: {memory}", flush=True)
            result[f"{fmt}_{memory}"] = _measure(args, stack, expert_bytes, gen, cuda, kernel, reference)
    result.update(hidden=H, intermediate=I, pool=P, kernel_unavailable=cpu_moe.unavailable_reason())
    (args.out / "cpu_experts.json").write_text(json.dumps(result, indent=2))


SCALE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _spec(fmt: str):
    """A format name's stored spec: FP8, MXFP4 or group quantization, the last with its scales' dtype
    after a colon (`int4-g32:fp16`: GGUF's Q4_0 as it is held; default bf16)."""
    if fmt == "mxfp4":
        return MXFP4
    base, _, scales = fmt.partition(":")
    return parse_fp8(base) or parse_quant(base, SCALE_DTYPES[scales or "bf16"])


def _quantized(source: dict, spec, cuda: bool) -> dict:
    """The bf16 pool's experts in `spec`'s stacked slot tensors (quantized on the GPU when there is one;
    FP8 and MXFP4 through their expert formats' own encoders, on the CPU)."""
    if spec is MXFP4 or parse_fp8(spec.name) is not None:
        from moestream.experts.format import ExpertShape, stored_format

        P, two_i, H = source["gate_up"].shape
        fmt, I = stored_format(spec, torch.bfloat16), two_i // 2
        out = fmt.empty(ExpertShape(H, I), P)
        for e in range(P):
            gate_up = source["gate_up"][e].float()
            fmt.encode(gate_up[:I], gate_up[I:], source["down"][e].float(), {n: t[e] for n, t in out.items()})
        return out
    out = {}
    for proj, stack in source.items():
        parts = [quantize(w.cuda() if cuda else w.float(), spec).parts() for w in stack]
        for part in parts[0]:
            out[f"{proj}.{part}"] = torch.stack([p[part].cpu() for p in parts]).contiguous()
    return out


def _paths(fmt: str):
    """(C kernel, plain-torch reference) for experts of `fmt`, each as f(x, stack, ids, weights)."""
    if fmt == "bf16":
        return (lambda x, st, ids, w: cpu_moe.cpu_moe(x, st, ids, w, out_dtype=torch.float32),
                lambda x, st, ids, w: moe_reference(x, st["gate_up"], st["down"], ids, w))
    spec = _spec(fmt)
    if spec is MXFP4:
        from moestream.kernels.mxfp4_moe import mxfp4_moe_reference
        return (lambda x, st, ids, w: cpu_moe.cpu_moe_quant(x, st, ids, w, spec, out_dtype=torch.float32),
                lambda x, st, ids, w: mxfp4_moe_reference(x, st, ids, w))
    return (lambda x, st, ids, w: cpu_moe.cpu_moe_quant(x, st, ids, w, spec, out_dtype=torch.float32),
            lambda x, st, ids, w: quant_moe_reference(x, st, ids, w, spec))


def _host(t: torch.Tensor, memory: str, cuda: bool) -> torch.Tensor:
    if memory == "pinned":
        return t.pin_memory() if cuda else t.clone()
    import mmap
    buf = mmap.mmap(-1, t.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)
    out.copy_(t)
    if cuda:
        rc = torch.cuda.cudart().cudaHostRegister(out.data_ptr(), out.nbytes, 0)
        assert int(rc) == 0, rc
    out._keep = buf
    return out


def _measure(args, stack, expert_bytes, gen, cuda, kernel_fn, reference_fn) -> dict:
    H, P = args.hidden, args.pool
    rows = []
    cores = len(cpu_moe.usable_cpus())
    for threads in args.threads or sorted({1, max(1, cores // 2), max(1, cores - 1), cores}):
        cpu_moe.set_threads(threads)
        torch.set_num_threads(threads)
        for m in args.experts_per_call:
            for T in args.tokens:
                x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
                w = torch.rand(T, m, generator=gen)

                def ids(i: int) -> torch.Tensor:   # m distinct experts, every token routed to all of them
                    first = (i * m) % (P - m)
                    return torch.arange(first, first + m, dtype=torch.int32).expand(T, m).contiguous()

                if args.prefetch:   # every distance in turn, rounds over: the median of each
                    times = {pf: [] for pf in args.prefetch}
                    for _ in range(args.rounds):
                        for pf in args.prefetch:
                            cpu_moe.set_prefetch(pf)
                            times[pf].append(timed(lambda i: kernel_fn(x, stack, ids(i), w), args.calls))
                    for pf, ts in times.items():
                        t = sorted(ts)[len(ts) // 2]
                        rows.append(dict(threads=threads, experts=m, tokens=T, prefetch=pf, kernel_us=t * 1e6,
                                         kernel_gb_s=m * expert_bytes / t / 1e9))
                        print(f"threads {threads:3d}  experts {m}  tokens {T:2d}  prefetch {pf:5d}  C kernel "
                              f"{t * 1e6:8.1f} us ({m * expert_bytes / t / 1e9:6.1f} GB/s; rounds "
                              + " ".join(f"{m * expert_bytes / x / 1e9:.0f}" for x in ts) + ")", flush=True)
                    continue
                kernel = timed(lambda i: kernel_fn(x, stack, ids(i), w), args.calls)
                ref = timed(lambda i: reference_fn(x, stack, ids(i), w), max(2, args.calls // 8))
                row = dict(threads=threads, experts=m, tokens=T, kernel_us=kernel * 1e6, torch_us=ref * 1e6,
                           kernel_gb_s=m * expert_bytes / kernel / 1e9, torch_gb_s=m * expert_bytes / ref / 1e9)
                rows.append(row)
                print(f"threads {threads:3d}  experts {m}  tokens {T:2d}  C kernel {kernel * 1e6:8.1f} us "
                      f"({row['kernel_gb_s']:6.1f} GB/s)   torch {ref * 1e6:8.1f} us ({row['torch_gb_s']:6.1f} GB/s)",
                      flush=True)
    result = dict(rows=rows)
    torch.set_num_threads(cores)
    span = max(1, min(32, P // 4))
    big = max(stack.values(), key=lambda t: t.nbytes)
    words = big.view(P, -1).view(torch.float32)   # the bytes as fp32 words: a sum reads them once, converts nothing

    read = timed(lambda i: words[(i * span) % (P - span):(i * span) % (P - span) + span].sum(), 8)
    result.update(read_gb_s=span * big[0].nbytes / read / 1e9)
    print(f"DRAM read by torch.sum on {cores} threads: {result['read_gb_s']:.1f} GB/s")
    if cuda:
        dest = {n: torch.empty_like(t[0], device="cuda") for n, t in stack.items()}
        stream = torch.cuda.Stream()

        def copy(i: int) -> None:
            with torch.cuda.stream(stream):
                for n, d in dest.items():
                    d.copy_(stack[n][i % P], non_blocking=True)
            stream.synchronize()

        per = timed(copy, args.calls)
        result.update(copy_us=per * 1e6, copy_gb_s=expert_bytes / per / 1e9)
        print(f"PCIe copy of one expert: {per * 1e6:.1f} us ({expert_bytes / per / 1e9:.1f} GB/s)")
    return result


if __name__ == "__main__":
    main()
