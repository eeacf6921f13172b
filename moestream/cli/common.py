"""What the commands share beyond their flags: the checks of paths and prompts made before any
work, the EngineConfig of the flags, loading the engine and reporting it, the bank's statistics."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from moestream.cli.interrupts import interrupts
from moestream.errors import InputError

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"   # moestream/demo_model


def check_output_folder(path: str | None, flag: str) -> None:
    """A folder the run will create or write into: not a file, and its nearest existing folder writable."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise InputError(f"{flag} {path} is a file; give a folder.")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise InputError(f"{flag} {path}: {existing} is not a writable folder; choose another path.")


def check_output(path: str | None, flag: str) -> None:
    """An output path can be written (its folder exists and is writable, it is not a folder): checked
    before any work, so a long run never fails at its last step."""
    if path is None or path == "-":   # "-": stdout
        return
    target = Path(path).expanduser()
    folder = target.parent
    if target.is_dir():
        raise InputError(f"{flag} {path} is a folder; give a file path.")
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another path.")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{flag} {path}: the folder {folder} is not writable; choose another path.")


def parse_token_ids(text: str, where: str) -> list[int]:
    """Space-separated token ids (prompts of checkpoints without a tokenizer); names the first bad one."""
    ids = []
    for word in text.split():
        if not (word.isascii() and word.isdigit()):   # "²³" is digits to str.isdigit, not to int()
            raise InputError(f"{where} holds {word!r}, which is not a token id (this checkpoint has no tokenizer "
                             "files, so prompts are space-separated non-negative integers).")
        ids.append(int(word))
    return ids


def model_arg(value: str | None) -> str:
    """MODEL, or the bundled demo model; a local path is checked here (it exists, it is a checkpoint
    folder that may be read, or a GGUF file whose header and architecture we read), before torch
    imports or any weight loads."""
    from moestream.checkpoint.resolve import local_checkpoint

    if value:
        path = local_checkpoint(value)
        if path is not None and path.suffix.lower() == ".gguf":
            from moestream.checkpoint.gguf_file import open_gguf

            open_gguf(path)
        return value
    if not (DEMO_MODEL / "config.json").is_file():
        raise InputError("no MODEL was given and the bundled demo model is missing; pass a checkpoint folder or hub id.")
    return str(DEMO_MODEL)


def checked_model(args) -> str:
    """What a loading command checks before anything heavy imports: MODEL (or the demo model) and
    every memory size flag. Returns the model to load."""
    model = model_arg(args.model)
    check_sizes(args)
    return model


SIZE_FLAGS = ("--gpu-memory", "--memory", "--host-memory", "--kv-cache-memory", "--prefix-cache-memory")


def check_sizes(args) -> None:
    """Every memory size flag parses, checked before anything loads; the message names the flag."""
    from moestream.sizes import parse_bytes

    for flag in SIZE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        try:
            parse_bytes(value)
        except InputError:
            raise InputError(f"{flag} {value!r} is not a memory size; write it like 16GiB, 12000MB or 8G.") from None


def check_chat_template(model: str) -> None:
    """--chat needs a chat template: read from the checkpoint's tokenizer files (a local folder),
    before any weight loads."""
    from moestream.checkpoint.resolve import chat_template_of, has_tokenizer, local_checkpoint

    folder = local_checkpoint(model)
    if folder is None:   # a hub id: the engine's own check, after the download
        return
    if not has_tokenizer(folder):
        raise InputError("--chat needs the checkpoint's tokenizer and chat template, and this checkpoint has no "
                         "tokenizer files; run without --chat and pass token ids.")
    if chat_template_of(folder) is None:
        raise InputError(f"{folder} has no chat template (none in tokenizer_config.json, no chat_template.jinja); "
                         "run without --chat to use the prompt as it is.")


def set_threads(args) -> None:
    """torch's intra-op threads: --cpu-threads, else OMP_NUM_THREADS where set, else every core this
    process may use but one (the rest of the machine stays responsive; on a CPU shared with other
    work, torch's default of one thread per core collapses under contention). Unlike the CPU expert
    kernel's team (`cpu_moe.default_threads`, at most 16), not capped: a CPU engine's prompts are
    matrix products that scale with the cores."""
    if not getattr(args, "own_process", False):   # main() called from a program (tests): its threads stay its own
        return
    import torch

    from moestream.kernels import cpu_moe

    threads = getattr(args, "cpu_threads", None)
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return
        threads = cpu_moe.all_but_one(len(cpu_moe.usable_cpus()))
    torch.set_num_threads(threads)


def recipe(args):
    from moestream.quant.recipe import QuantRecipe, parse_layer_formats

    return QuantRecipe(experts=getattr(args, "experts", None), shared=getattr(args, "shared", None),
                       attention=getattr(args, "attention", None), embeddings=getattr(args, "embeddings", None),
                       layer_formats=parse_layer_formats(getattr(args, "layer_format", None)))


def parse_devices(text: str | None) -> list[str] | None:
    """--devices: a comma-separated list, `all` (every GPU), or a GPU count."""
    if text is None:
        return None
    import torch

    text = text.strip()
    if text == "all" or text.isdigit():
        count = torch.cuda.device_count()
        want = count if text == "all" else int(text)
        if count == 0:
            raise InputError(f"--devices {text} needs CUDA devices and this machine has none; list devices such as cpu,cpu.")
        if want > count:
            raise InputError(f"--devices {text}: this machine has {count} CUDA devices.")
        return [f"cuda:{i}" for i in range(want)]
    devices = [d.strip() for d in text.split(",")]
    for d in devices:
        try:
            torch.device(d)
        except (RuntimeError, ValueError):
            raise InputError(f"--devices: {d!r} is not a device; write e.g. cuda:0,cuda:1 or cpu,cpu.") from None
    return devices


def torchrun():
    """This process's place in a torchrun launch (None when not launched by torchrun)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    from moestream.runtime.distributed import torchrun_env

    return torchrun_env()


def follow_rank_0(launched) -> int:
    """A torchrun rank other than 0: make rank 0's model calls until it stops (it owns the command's
    output, the server socket and every error message)."""
    from moestream.engine.follower import run_follower

    run_follower(launched.rank, launched.store_port, launched.world, timeout_s=600.0, host=launched.master_addr)
    return 0


def engine_config(args):
    """The EngineConfig of a command's flags (run, bench, profile, perplexity, check, serve): what
    needs no model (the path, the sizes) is checked before torch imports."""
    model = checked_model(args)
    if args.gpu_memory is not None and args.memory is not None:
        raise InputError("give either --gpu-memory or --memory (they are the same budget), not both.")
    check_output_folder(getattr(args, "prepack", None), "--prepack")

    from moestream.engine import BankConfig, EngineConfig, RuntimeConfig, WarmStartConfig

    devices = parse_devices(getattr(args, "devices", None))
    device = args.device
    launched = torchrun()
    if launched is not None and devices is None:   # torchrun started one process per rank: place them
        from moestream.runtime.distributed import torchrun_devices

        devices, device = torchrun_devices(launched, args.device), "auto"
    runtime = RuntimeConfig(device=device, dtype=args.dtype, max_context=args.max_context, devices=devices,
                            mla_absorbed=getattr(args, "mla_absorbed", False),
                            dist_backend=getattr(args, "dist_backend", "auto"), kv_layout=args.kv_layout,
                            kv_block_size=args.kv_block_size, kv_cache_memory=args.kv_cache_memory,
                            overlap=getattr(args, "overlap", "auto"), prefill_chunk=getattr(args, "prefill_chunk", "auto"),
                            pack_prompts=getattr(args, "pack_prompts", "on") == "on")
    bank = BankConfig(gpu_memory=args.gpu_memory if args.gpu_memory is not None else args.memory,
                      capacity=args.capacity, host_memory=getattr(args, "host_memory", None),
                      host_tier=getattr(args, "host_tier", "auto"), miss_policy=getattr(args, "miss_policy", "auto"),
                      residency=getattr(args, "residency", "lcp"), prefetch=getattr(args, "prefetch", False),
                      cpu_misses=getattr(args, "cpu_misses", None), cpu_threads=getattr(args, "cpu_threads", None),
                      prompt_cpu_misses=getattr(args, "prompt_cpu_misses", 0.0))
    warm = WarmStartConfig(discovery=getattr(args, "discovery", True), profile=getattr(args, "profile", None),
                           pin_top_k=getattr(args, "pin_top_k", None), pin_threshold=getattr(args, "pin_threshold", None),
                           prepack=getattr(args, "prepack", None), warmup_tokens=_warmup_tokens(args))
    return EngineConfig(model, runtime, bank, warm, recipe(args)).validate()


def load_engine(args):
    import moestream

    t0 = time.perf_counter()
    config = engine_config(args)
    set_threads(args)
    if config.quant.quantized:
        print("[moestream] quantizing on load (a slower start; `moestream convert` once to skip this)", file=sys.stderr)
    engine = moestream.load(config)
    interrupts.check()
    load_s = time.perf_counter() - t0
    _report_load(engine, load_s, args)
    return engine, load_s


def _warmup_tokens(args) -> int:
    if getattr(args, "warmup_tokens", None) is not None:
        if args.warmup_tokens < 0:
            raise InputError(f"--warmup-tokens must be >= 0, got {args.warmup_tokens}.")
        return args.warmup_tokens
    return 8 if getattr(args, "prepack", None) else 0


def _report_load(engine, load_s: float, args) -> None:
    """The start-up story: plan, discovery, snapshot (always a line for --prepack; details with --verbose)."""
    if args.verbose:
        print(engine.plan.memory.explain(), file=sys.stderr)
        if engine.discovery is not None:
            d = engine.discovery
            print(f"[moestream] discovery: {d.tokens} prompt tokens, router-only, {d.seconds * 1000:.0f} ms", file=sys.stderr)
    status = engine.prepack
    if status is not None and engine.prepack_error:
        print(f"[moestream] warning: built the bank ({status.reason}) but {engine.prepack_error}", file=sys.stderr)
    elif status is not None:
        what = (f"loaded the prepacked bank from {status.folder} in {status.seconds:.2f} s" if status.loaded
                else f"built the bank ({status.reason}); saved it to {status.folder}")
        print(f"[moestream] {what}; start-up {load_s:.2f} s", file=sys.stderr)


def report_stats(engine, args, run: dict | None = None) -> None:
    """--stats' table and --json's bank statistics; `run`: the command's own figures (run's load time,
    time to first token, decode rate), under "run" in the JSON."""
    if getattr(args, "stats", False):
        print(stats_text(engine), file=sys.stderr)
    if getattr(args, "json", None):
        emit_json(args.json, {**engine.stats(), **({"run": run} if run is not None else {})})


def stats_text(engine) -> str:
    """--stats: the bank's table per layer (rank 0's with several devices), then a line per rank."""
    engine.bank.sync_stats()
    table = engine.bank.stats.table()
    if engine.bank.policy_note:
        table += "\n" + engine.bank.policy_note
    fetcher = engine.bank.fetcher
    if fetcher is not None and fetcher.costs is not None:
        table += "\n" + fetcher.costs.describe()
    hybrid = engine.bank.hybrid_misses
    if hybrid is not None:
        table += "\n" + hybrid.describe()
    if engine.group is None:
        return table
    return table + "\n" + ranks_table(engine.stats()["ranks"])


def ranks_table(ranks: list[dict]) -> str:
    """One line per rank of an expert-parallel group: its bank and its all-reduces (calls replayed
    inside CUDA graphs are counted, not timed)."""
    rows = [("rank", "device", "hits", "misses", "hit rate", "MB copied", "all-reduces", "in graphs", "MB reduced",
             "all-reduce s")]
    for rank, r in enumerate(ranks):
        c = r.get("collective", {})
        rows.append((str(rank), r.get("device", "?"), str(r["hits"]), str(r["misses"]), f"{r['hit_rate']:.1%}",
                     f"{r['bytes_copied'] / 1e6:.1f}", str(c.get("calls", 0)), str(c.get("graph_calls", 0)),
                     f"{c.get('bytes', 0) / 1e6:.1f}", f"{c.get('seconds', 0.0):.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def emit_json(target: str, data) -> None:
    """`--json`'s output: "-" prints one line of JSON on stdout, anything else is a file written whole."""
    if target == "-":
        import json

        print(json.dumps(data))
    else:
        write_json(Path(target), data)


def write_json(path: Path, data) -> None:
    from moestream.fileio import write_json_atomic

    write_json_atomic(path, data, indent=2)

