"""Decode across GPUs (expert parallel): tok/s at batch 1 and batch 16 on 1, 2 or 4 devices, fully
resident and with each rank's bank at a fraction of its share of the experts, and the all-reduce's
cost beside the step it sits in.

Each configuration loads its own engine (one expert-parallel group per process; its followers are
started and stopped with it). Routing is stated in every row: `--routing uniform` (the default:
random weights route nearly the same experts for every token, a best case for a bank) draws k
distinct experts per token from one seed on every rank; `--routing trace --trace FILE` replays a
recorded trace on every rank; `--routing model` keeps the random model's own.

    python benchmarks/expert_parallel_decode.py --ckpt /tmp/q3 --out /tmp/ep --devices 1 2 \\
        --bank-share 1 0.25 --batches 1 16 [--allreduce] [--overlap off auto] \\
        [--llama-bin ~/llama.cpp/build/bin --gguf /tmp/q3-bf16.gguf]

`--ckpt` may be the GGUF itself (`--ckpt /tmp/q3.gguf --gguf /tmp/q3.gguf`): both engines then read one file.

Batch 1 is `moestream bench`'s measurement (a 512-token prompt, then `--gen-tokens` decoded, decode
tok/s after the first token). Batch B decodes B random prompts of `--batch-prompt-tokens` together:
aggregate tok/s over the decode steps, the median of three differences of two runs that differ
only in their token count, both past every prompt's prefill (so prefill and start-up cancel). `--allreduce` times the all-reduces alone: one per MoE layer, of a
(B, hidden) tensor in the compute dtype, B = 1 and 16, replayed as a CUDA graph of one step's worth
on one process a GPU, for each GPU count above one: the floor the all-reduces add to a step; beside
NCCL's, the same reduces through symmetric memory's one-shot kernel (each rank reads its peers'
partials over NVLink). `--overlap` (one row per mode)
compares decode launched one step ahead of the host (`auto`: on where the ranks replay whole steps)
with steps waited for one by one (`off`), on the same GPUs in one run.

The peer, in the same run: `--llama-bin DIR --gguf FILE` (a GGUF of the same shape, e.g. from
`benchmarks/random_gguf.py --token-routing`: llama.cpp follows the file's own routing, and a plain random
file's few favourite experts flatter its batches at `--n-cpu-moe`) runs llama.cpp on the same GPU counts: `llama-bench` for batch 1 and
`llama-batched-bench` for larger batches, each `--split-mode` of `--llama-split` (one GPU: `none`),
the whole model on the GPUs and, for a bank share s, `--n-cpu-moe` = (1 − s) × layers (the same
fraction of the experts on the GPUs as ours: our s of each rank's share is s of them all). The
table printed at the end (and written as `expert_parallel_decode.md`) sets each of our rows beside
llama.cpp's best split on the same GPU count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moestream  # noqa: E402
from benchmarks.common import log, write_result  # noqa: E402
from benchmarks.llama_cpp import llama_records  # noqa: E402
from moestream.fileio import write_bytes_atomic  # noqa: E402
from moestream.bench import apply_routing, run_bench  # noqa: E402
from moestream.checkpoint.gguf_file import is_gguf, open_gguf  # noqa: E402


def batch_decode_tok_s(engine, batch: int, prompt_tokens: int, gen_tokens: int, seed: int = 0,
                       lead: int = 8, repetitions: int = 3) -> float:
    """Aggregate decode tok/s of `batch` prompts decoded together: the median over `repetitions` of
    (run of `lead` + `gen_tokens` tokens) minus (run of `lead` tokens), same prompts. Both runs have
    finished every prompt's (chunked) prefill and `lead` decode steps before the runs differ, so the
    difference is `gen_tokens` whole batched decode steps and nothing else."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, engine.config.vocab_size, (prompt_tokens,), generator=gen).tolist()
               for _ in range(batch)]
    engine.generate(prompts, max_tokens=lead + gen_tokens, ignore_eos=True)   # warm: graphs for this batch

    def timed(n: int) -> float:
        engine.runner.reset_routing()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        start = time.perf_counter()
        engine.generate(prompts, max_tokens=n, ignore_eos=True)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        return time.perf_counter() - start

    spans = sorted(timed(lead + gen_tokens) - timed(lead) for _ in range(repetitions))
    return batch * gen_tokens / spans[len(spans) // 2]


def shape_of(ckpt: str) -> dict:
    """The experts per layer, layers and hidden size of a checkpoint folder or a GGUF file."""
    if is_gguf(ckpt):
        gguf = open_gguf(ckpt)
        return dict(num_experts=int(gguf.get("expert_count")), num_hidden_layers=int(gguf.get("block_count")),
                    hidden_size=int(gguf.get("embedding_length")))
    config = json.loads((Path(ckpt) / "config.json").read_text())
    return {key: config.get(key) for key in ("num_experts", "num_hidden_layers", "hidden_size")}


def measure(args, world: int, share: float, overlap: str = "auto") -> dict:
    devices = [f"cuda:{i}" for i in range(world)]
    num_experts = shape_of(args.ckpt)["num_experts"]
    capacity = None if share >= 1 else max(1, round(num_experts / world * share))
    kwargs = dict(device=devices[0]) if world == 1 else dict(devices=devices)
    if capacity is not None:   # a bank: its miss policy (hybrid: misses computed by each rank's CPU from pinned RAM)
        kwargs.update(miss_policy=args.miss_policy, **({"host_tier": "pinned"} if args.miss_policy == "hybrid" else {}))
    start = time.perf_counter()
    engine = moestream.load(args.ckpt, dtype="bfloat16", capacity=capacity, max_batch=max(args.batches),
                            kv_rows=max(args.batches), max_context=args.max_context, rank_timeout_s=600, overlap=overlap, **kwargs)
    load_s = time.perf_counter() - start
    try:
        routing = apply_routing(engine, args.routing, args.trace)
        row = dict(gpus=world, bank_share=share, capacity_per_rank=capacity, num_experts=num_experts,
                   routing="model" if routing is None else routing.label, load_s=load_s,
                   graphs=engine.runner.cuda_graphs, overlap=overlap, overlapping=engine.overlapping,
                   miss_policy=engine.bank.miss_policy)
        for batch in args.batches:
            if batch == 1:
                result = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s=load_s, routing=routing)
                row["b1_decode_tok_s"] = result.decode_tok_s
                row["b1_hit_rate"] = result.decode_hit_rate
                row["b1_peak_gib"] = result.peak_device_bytes / 2**30
            else:
                row[f"b{batch}_decode_tok_s"] = batch_decode_tok_s(engine, batch, args.batch_prompt_tokens,
                                                                  args.gen_tokens)
        if world > 1:
            row["ranks_collective"] = [r["collective"] for r in engine.stats()["ranks"]]
    finally:
        engine.close()
        release(engine)
    return row


def _llama(command: list[str], world: int, timeout: float = 420) -> list[dict]:
    """Run one llama.cpp tool on the first `world` GPUs; the JSON records it printed (one per line or one
    list), or one record naming why it failed."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(world)))
    log("$ " + " ".join(command))
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(error=f"no result within {timeout:.0f} s")]
    records = llama_records(done.stdout + "\n" + done.stderr)
    if done.returncode != 0:   # a split mode that fails ends the tool after the records before it
        last = (done.stderr or done.stdout).strip().splitlines()[-1:]
        records.append(dict(error=f"exit {done.returncode}: {last[0] if last else 'no output'}"))
    return records or [dict(error="no JSON record in the output")]


def llama_rows(args, world: int, share: float) -> list[dict]:
    """llama.cpp's decode tok/s on `world` GPUs, one row per split mode: batch 1 from llama-bench
    (`-p 0 -n gen_tokens -r 3`), larger batches from llama-batched-bench (`-npp batch_prompt_tokens
    -ntg gen_tokens -npl B`, its `speed_tg`: the decode steps' aggregate)."""
    layers = shape_of(args.ckpt)["num_hidden_layers"]
    n_cpu_moe = 0 if share >= 1 else round(layers * (1 - share))
    modes = ["none"] if world == 1 else args.llama_split
    common = ["-m", args.gguf, "-ngl", "99", "--n-cpu-moe", str(n_cpu_moe)]
    rows = {mode: dict(engine="llama.cpp", gpus=world, bank_share=share, n_cpu_moe=n_cpu_moe, split=mode)
            for mode in modes}
    bench, batched = (str(Path(args.llama_bin) / tool) for tool in ("llama-bench", "llama-batched-bench"))
    for mode, row in rows.items():   # one mode a call: a mode llama.cpp refuses ends only its own call
        for batch in args.batches:
            if batch == 1:
                records = _llama([bench, *common, "-fa", "1", "-p", "0", "-n", str(args.gen_tokens), "-r", "3",
                                  "-sm", mode, "-o", "json"], world)
                found = [r["avg_ts"] for r in records if r.get("split_mode") == mode]
            else:
                context = batch * (args.batch_prompt_tokens + args.gen_tokens) + 256
                records = _llama([batched, *common, "-fa", "on", "-c", str(context), "-npp",
                                  str(args.batch_prompt_tokens), "-ntg", str(args.gen_tokens), "-npl", str(batch),
                                  "-sm", mode, "--output-format", "jsonl"], world)
                found = [r["speed_tg"] for r in records if r.get("pl") == batch]
            row.update({f"b{batch}_decode_tok_s": found[-1]} if found else
                       {f"b{batch}_error": next((r["error"] for r in records if "error" in r), "no record")})
    return list(rows.values())


def markdown(result: dict) -> str:
    """Our decode tok/s per GPU count, bank share and batch beside llama.cpp's best split mode there,
    the ratio (above 1: ours is faster), and where `--allreduce` ran, the share of our step that
    step's all-reduces take alone (NCCL, timed apart from the step)."""
    lines = ["| GPUs | bank share | batch | ours tok/s | llama.cpp tok/s (best split) | ours ÷ llama.cpp | all-reduce share |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        if row.get("overlap", "auto") != "auto":
            continue
        for key in sorted((k for k in row if k.endswith("_decode_tok_s")), key=lambda k: int(k[1:k.index("_")])):
            peers = [(p[key], p["split"]) for p in result.get("llama_cpp", [])
                     if p["gpus"] == row["gpus"] and p["bank_share"] == row["bank_share"] and key in p]
            best = max(peers, default=None)
            ours, batch = row[key], int(key[1:key.index("_")])
            cells = (f"{best[0]:,.1f} ({best[1]})", f"{ours / best[0]:.2f}×") if best else ("–", "–")
            floor = result.get("allreduce", {}).get(str(row["gpus"]), {}).get(f"b{batch}_nccl_allreduce_ms_per_step")
            share = f"{floor / 1e3 / (batch / ours):.0%}" if floor and ours > 0 else "–"
            lines.append(f"| {row['gpus']} | {row['bank_share']:g} | {batch} | {ours:,.1f} | "
                         f"{cells[0]} | {cells[1]} | {share} |")
    routing = next((r["routing"] for r in result["rows"] if "routing" in r), "?")
    return "\n".join(lines) + f"\n\nOur routing: {routing}.\n"


def visible(worlds: list[int]) -> list[int]:
    """The GPU counts asked for that this machine has (the others logged as skipped)."""
    for world in worlds:
        if world > torch.cuda.device_count():
            log(f"skipping {world} GPUs: {torch.cuda.device_count()} visible")
    return [world for world in worlds if world <= torch.cuda.device_count()]


def release(engine) -> None:
    """Free a closed engine's device memory before the next configuration loads: its modules, bank and
    graphs reference each other, so they go at a collection, and the caching allocator keeps what they
    held until it is emptied."""
    engine.model = engine.bank = engine.runner = None
    gc.collect()
    torch.cuda.empty_cache()
    log(f"after release: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated on {torch.cuda.current_device()}")


def _timed_graph(build, reps: int = 200) -> float:
    """Seconds per replay of a CUDA graph of one step's reduces (`build` queues them)."""
    build()   # warm outside the capture (NCCL and symmetric memory set up lazily)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        build()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, layers: int, batches: list[int], out: str) -> None:
    """One step's all-reduces as a graph, two ways: NCCL's `all_reduce`, and symmetric memory's
    one-shot (each rank reads every peer's buffer over NVLink and sums, one kernel, no NCCL
    protocol), when this torch and these GPUs give it."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    results: dict[str, float | str] = {}
    for batch in batches:
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        results[f"b{batch}_nccl"] = _timed_graph(lambda: [dist.all_reduce(x) for _ in range(layers)])
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        rows = max(batches)
        buffer = symm_mem.empty((rows, hidden), dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buffer, group.group_name)
        for batch in batches:
            x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
            want = x.clone()
            dist.all_reduce(want)
            got = torch.empty_like(x)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[:batch], x, "sum", group.group_name, got)
            torch.cuda.synchronize()
            results[f"b{batch}_symm_exact"] = bool(torch.equal(got, want))
            results[f"b{batch}_symm_one_shot"] = _timed_graph(
                lambda: [torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[:batch], x, "sum", group.group_name, got)
                         for _ in range(layers)])
    except Exception as exc:   # an older torch, no NVLink peer access: the NCCL figures stand alone
        results["symm_error"] = f"{type(exc).__name__}: {exc}"[:400]
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def allreduce_floor(hidden: int, layers: int, batches: list[int], world: int = 2) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/allreduce_{os.getpid()}.json"
    mp.spawn(_allreduce_rank, args=(world, port, hidden, layers, batches, out), nprocs=world)
    per_step = json.loads(Path(out).read_text())
    return {f"{key}_allreduce_ms_per_step" if isinstance(value, float) else key:
            value * 1e3 if isinstance(value, float) else value for key, value in per_step.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint folder, or a GGUF file (e.g. the one --gguf names: "
                                                   "both engines on the same file)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bank-share", type=float, nargs="+", default=[1.0, 0.25],
                    help="each rank's bank as a fraction of its share of the experts (1 = resident)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch-prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=4096,
                    help="KV positions per sequence (the plan reserves them for every batch row; a model's own "
                         "maximum, 262,144 for Qwen3-Next, would leave no room for the experts)")
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default="uniform")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--overlap", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                    help="decode overlap modes to measure, one row each")
    ap.add_argument("--miss-policy", choices=["auto", "fetch", "hybrid"], default="auto",
                    help="the bank rows' miss policy (auto: hybrid on one GPU, fetch on several)")
    ap.add_argument("--allreduce", action="store_true",
                    help="also time one step's all-reduces alone, on each GPU count above 1")
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's bin folder: run it beside ours (needs --gguf)")
    ap.add_argument("--gguf", default=None, help="a GGUF of the checkpoint's shape, for --llama-bin")
    ap.add_argument("--llama-split", nargs="+", default=["layer", "row", "tensor"],
                    help="llama.cpp's --split-mode values to measure on more than one GPU")
    args = ap.parse_args()
    if bool(args.llama_bin) != bool(args.gguf):
        ap.error("--llama-bin and --gguf go together: give both to run llama.cpp beside ours, or neither")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"rows": [], "llama_cpp": [], "allreduce": {}}
    config = shape_of(args.ckpt)
    # One GPU count at a time, ours then its all-reduce floor then llama.cpp's, the table rewritten after
    # each: a run cut short (a machine lent for minutes) still has whole pairs for the counts it reached.
    for world in visible(args.devices):
        for share in args.bank_share:
            for overlap in args.overlap:
                try:
                    row = measure(args, world, share, overlap)
                except Exception as exc:   # one configuration failing leaves the others' rows
                    row = dict(gpus=world, bank_share=share, overlap=overlap, error=f"{type(exc).__name__}: {exc}")
                log(json.dumps(row))
                result["rows"].append(row)
                write_result(out, "expert_parallel_decode", result)
        if args.allreduce and world > 1:
            floor = allreduce_floor(config["hidden_size"], config["num_hidden_layers"], args.batches, world)
            log(json.dumps(floor))
            result["allreduce"][str(world)] = floor
        for share in args.bank_share if args.llama_bin else ():
            for row in llama_rows(args, world, share):
                log(json.dumps(row))
                result["llama_cpp"].append(row)
        write_result(out, "expert_parallel_decode", result)
        write_bytes_atomic(out / "expert_parallel_decode.md", markdown(result).encode())
    log(markdown(result))


if __name__ == "__main__":
    main()
