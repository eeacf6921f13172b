"""`moestream run | bench | profile | check | perplexity | archs`: the command line. Errors print one line and exit 1."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from moestream.errors import InputError, MoestreamError

DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"


class Parser(argparse.ArgumentParser):
    """argparse with our one-line errors (`moestream: error: --flag ...; see ... --help`) and exit 1,
    like every other bad input."""

    def error(self, message: str):
        message = message.replace("argument ", "", 1) if message.startswith("argument ") else message
        print(f"moestream: error: {message}; see `{self.prog} --help`.", file=sys.stderr)
        sys.exit(1)


def integer(low: int | None = None, high: int | None = None):
    """An argparse type: an integer in [low, high] (either bound optional)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high)}, got {value}")
        return value
    return parse


def number(low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite number in the given (half-)open or closed range."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        bad = (value != value or value in (float("inf"), float("-inf"))
               or (low is not None and (value < low or (low_open and value == low)))
               or (high is not None and (value > high or (high_open and value == high))))
        if bad:
            raise argparse.ArgumentTypeError(f"must be {_range(low, high, low_open, high_open)}, got {text}")
        return value
    return parse


def share_or_auto(text: str) -> float | str:
    """--cpu-misses: `auto` or a share from 0 to 1."""
    return "auto" if text == "auto" else number(0, 1)(text)


def _range(low, high, low_open: bool = False, high_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


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


def parse_token_ids(text: str, where: str) -> list[int]:
    """Space-separated token ids (prompts of checkpoints without a tokenizer); names the first bad one."""
    ids = []
    for word in text.split():
        if not word.isdigit():
            raise InputError(f"{where} holds {word!r}, which is not a token id (this checkpoint has no tokenizer "
                             "files, so prompts are space-separated non-negative integers).")
        ids.append(int(word))
    return ids


def check_output(path: str | None, flag: str) -> None:
    """An output path can be written (its folder exists and is writable, it is not a folder): checked
    before any work, so a long run never fails at its last step."""
    if path is None:
        return
    target = Path(path).expanduser()
    folder = target.parent
    if target.is_dir():
        raise InputError(f"{flag} {path} is a folder; give a file path.")
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another path.")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{flag} {path}: the folder {folder} is not writable; choose another path.")


def _model_arg(value: str | None) -> str:
    if value:
        return value
    if not (DEMO_MODEL / "config.json").is_file():
        raise InputError("no MODEL was given and the bundled demo model is missing; pass a checkpoint folder or hub id.")
    return str(DEMO_MODEL)


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="checkpoint folder or hub id (default: the bundled demo model)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default: auto)")
    _add_devices_args(p)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-context", type=integer(2), default=None, help="KV cache length (default: the model's maximum)")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="launch each decode step before the host reads the last one's tokens, so the host's work "
                        "between steps runs while the device computes: auto (default) where a decode step reads "
                        "nothing back on a GPU (whole-step CUDA graphs); on; off")
    _add_kv_args(p)
    _add_budget_args(p)
    p.add_argument("--host-memory", default=None, help="pinned host RAM for experts off the device, e.g. 64GiB (default: 60%% of available RAM; beyond it experts are read from disk)")
    p.add_argument("--host-tier", default="auto", choices=["auto", "pinned", "disk"], help="where missing experts come from")
    p.add_argument("--miss-policy", default="auto", choices=["auto", "fetch", "hybrid", "skip"],
                   help="hybrid = the GPU reads some missing experts from host RAM in place while a CPU thread "
                        "computes the others, decode steps as whole CUDA graphs (exact; needs a GPU and the pinned host "
                        "tier; bf16/fp32, 8/4/2-bit or NF4 experts); fetch = copy missing experts into the bank (exact); skip = drop "
                        "non-resident experts and renormalise (approximate); auto (default) = hybrid where it can "
                        "run, else fetch")
    p.add_argument("--residency", default="lcp", choices=["lcp", "lru"], help="which experts stay in the bank")
    p.add_argument("--cpu-misses", type=share_or_auto, default=None, metavar="SHARE|auto",
                   help="fetch: a decode step's missing experts computed on the CPU from host RAM while the rest are "
                        "copied: a share of them (1: all), or auto (split by costs measured at the first decode step) "
                        "(exact; needs the pinned host tier; off by default); hybrid: the CPU's share of a "
                        "one-stream step's missing experts, the GPU reading the rest (default auto: from 0.6, moved "
                        "while decoding until both sides finish together)")
    p.add_argument("--cpu-threads", type=integer(1), default=None, metavar="N",
                   help="threads the CPU computes missed experts with (--cpu-misses, --miss-policy hybrid; default: "
                        "every core this process may use but one)")
    p.add_argument("--prefetch", action="store_true",
                   help="predict the next layer's experts and copy them ahead (fetch policy; measured slower at "
                        "the demo model's 65%% prediction accuracy, see BENCHMARKS.md)")
    p.add_argument("--no-discovery", dest="discovery", action="store_false",
                   help="fill a bounded bank without the router-only pass over a warm-up prompt")
    p.add_argument("--prepack", default=None, metavar="DIR",
                   help="load the warmed bank from this folder when it matches; otherwise build, warm and save it there")
    p.add_argument("--warmup-tokens", type=integer(0), default=None,
                   help="generate this many tokens before the first request (default: 8 with --prepack, else 0)")
    p.add_argument("--mla-absorbed", action="store_true",
                   help="multi-head latent attention models (DeepSeek-V2/V3, GLM-4.7-Flash): attend over the latent "
                        "cache with the key/value up-projections absorbed into the query and output, instead of "
                        "expanding every cached position per head")
    p.add_argument("--verbose", action="store_true", help="print the memory plan, discovery and prepack details to stderr")
    _add_quant_args(p)


def _add_devices_args(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="expert parallel: one rank per device, each holding a share of the experts: cuda:0,cuda:1 | "
                        "all | a GPU count | cpu,cpu (budgets are per device)" + what)
    p.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="the ranks' collectives (default: NCCL on CUDA, gloo on CPU); gloo lets two ranks share "
                        "one GPU, for testing and debugging")


def _add_quant_args(p: argparse.ArgumentParser, what: str = "quantize on load") -> None:
    """Precision per tensor class (routers always stay at full precision)."""
    names = "int8, int4, int3, int2, nf4, nf3 (optionally -g32/-g64/-g128), or bf16/fp16/fp32 for none"
    p.add_argument("--experts", default=None, metavar="FORMAT", help=f"routed experts ({what}): {names}")
    p.add_argument("--shared", default=None, metavar="FORMAT", help="shared experts and dense FFN layers")
    p.add_argument("--attention", default=None, metavar="FORMAT", help="attention projections")
    p.add_argument("--embeddings", default=None, metavar="FORMAT", help="token embeddings and the LM head")
    p.add_argument("--layer-format", action="append", default=[], metavar="LAYER=FORMAT",
                   help="override every quantized class of one layer, e.g. 0=int8 -1=int8 (repeatable)")


def _recipe(args):
    from moestream.quant.recipe import QuantRecipe, parse_layer_formats

    return QuantRecipe(experts=getattr(args, "experts", None), shared=getattr(args, "shared", None),
                       attention=getattr(args, "attention", None), embeddings=getattr(args, "embeddings", None),
                       layer_formats=parse_layer_formats(getattr(args, "layer_format", None)))


def _add_budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory", default=None, help="everything the engine may take on the device, e.g. 16GiB (default: free memory less headroom)")
    p.add_argument("--memory", default=None, help="alias of --gpu-memory that names no device (the RAM bank on CPU)")
    p.add_argument("--capacity", type=integer(1), default=None, help="bank slots per layer (overrides the budget's choice)")


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-layout", default="auto", choices=["auto", "paged", "rows"],
                   help="paged: keys and values in blocks shared by every sequence and the prefix cache; rows: one "
                        "full-context row per sequence; auto (default): paged where every layer keeps full keys and "
                        "values")
    p.add_argument("--kv-block-size", type=integer(1, 1024), default=16, metavar="N",
                   help="positions per block of a paged cache (default 16)")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="device memory of a paged cache, e.g. 4GiB (default: --max-batch full contexts plus "
                        "--prefix-cache-memory)")


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help="expert profile JSON from `moestream profile`: seeds the bank with its most used experts")
    pin = p.add_mutually_exclusive_group()
    pin.add_argument("--pin-top-k", type=integer(0), default=None, help="with --profile: pin the K most used experts of every layer")
    pin.add_argument("--pin-threshold", type=number(0, 1), default=None,
                     help="with --profile: pin the experts active on more than this fraction of tokens")


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


def _torchrun():
    """This process's place in a torchrun launch (None when not launched by torchrun)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    from moestream.runtime.distributed import torchrun_env

    return torchrun_env()


def _follow_rank_0(launched) -> int:
    """A torchrun rank other than 0: make rank 0's model calls until it stops (it owns the command's
    output, the server socket and every error message)."""
    from moestream.runtime.distributed import follow

    follow(launched.rank, launched.store_port, launched.world, timeout_s=600.0, host=launched.master_addr)
    return 0


def engine_config(args):
    """The EngineConfig of a command's flags (run, bench, profile, perplexity, check)."""
    from moestream.engine import BankConfig, EngineConfig, RuntimeConfig, WarmStartConfig

    if args.gpu_memory is not None and args.memory is not None:
        raise InputError("give either --gpu-memory or --memory (they are the same budget), not both.")
    check_output_folder(getattr(args, "prepack", None), "--prepack")
    devices = parse_devices(getattr(args, "devices", None))
    device = args.device
    launched = _torchrun()
    if launched is not None and devices is None:   # torchrun started one process per rank: place them
        from moestream.runtime.distributed import torchrun_devices

        devices, device = torchrun_devices(launched, args.device), "auto"
    runtime = RuntimeConfig(device=device, dtype=args.dtype, max_context=args.max_context, devices=devices,
                            mla_absorbed=getattr(args, "mla_absorbed", False),
                            dist_backend=getattr(args, "dist_backend", "auto"), kv_layout=args.kv_layout,
                            kv_block_size=args.kv_block_size, kv_cache_memory=args.kv_cache_memory,
                            overlap=getattr(args, "overlap", "auto"))
    bank = BankConfig(gpu_memory=args.gpu_memory if args.gpu_memory is not None else args.memory,
                      capacity=args.capacity, host_memory=getattr(args, "host_memory", None),
                      host_tier=getattr(args, "host_tier", "auto"), miss_policy=getattr(args, "miss_policy", "auto"),
                      residency=getattr(args, "residency", "lcp"), prefetch=getattr(args, "prefetch", False),
                      cpu_misses=getattr(args, "cpu_misses", None), cpu_threads=getattr(args, "cpu_threads", None))
    warm = WarmStartConfig(discovery=getattr(args, "discovery", True), profile=getattr(args, "profile", None),
                           pin_top_k=getattr(args, "pin_top_k", None), pin_threshold=getattr(args, "pin_threshold", None),
                           prepack=getattr(args, "prepack", None), warmup_tokens=_warmup_tokens(args))
    return EngineConfig(_model_arg(args.model), runtime, bank, warm, _recipe(args)).validate()


def _load(args):
    import moestream

    t0 = time.perf_counter()
    config = engine_config(args)
    if config.quant.quantized:
        print("[moestream] quantizing on load (a slower start; `moestream convert` once to skip this)", file=sys.stderr)
    engine = moestream.load(config)
    _interrupts.check()
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


def _read_prompt(args) -> str:
    """The prompt from -p or stdin, as text: bytes that are not UTF-8 become U+FFFD, never an error."""
    if args.prompt is not None:   # argv bytes that were not UTF-8 arrive as surrogates
        return args.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if sys.stdin is None or sys.stdin.isatty():
        raise InputError("no prompt: pass -p TEXT or pipe the prompt on stdin.")
    stream = getattr(sys.stdin, "buffer", None)
    text = stream.read().decode("utf-8", "replace") if stream is not None else sys.stdin.read()
    if not text:
        raise InputError("the prompt on stdin is empty; pass -p TEXT or pipe a prompt.")
    return text


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def cmd_run(args) -> int:
    prompt = _read_prompt(args)
    check_output(args.stats_json, "--stats-json")
    engine, load_s = _load(args)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, seed=args.seed, stop=args.stop, chat=args.chat)
    out = sys.stdout
    if engine.tokenizer is None:
        if args.chat:
            raise InputError("--chat needs the checkpoint's tokenizer and chat template, and this checkpoint has no "
                             "tokenizer files; run without --chat and pass token ids.")
        ids = parse_token_ids(prompt, "the prompt")
        for token in engine.stream_tokens(ids, **{k: v for k, v in kw.items() if k != "chat"}):
            _interrupts.check()
            out.write(f"{token} ")
            out.flush()
    else:
        for piece in engine.stream(prompt, **kw):
            _interrupts.check()
            out.write(piece)
            out.flush()
    out.write("\n")
    m = engine.last_metrics
    print(f"[moestream] load {load_s:.2f} s | prompt {m.prompt_tokens} tokens | TTFT {m.ttft_s * 1000:.0f} ms | "
          f"generated {m.generated_tokens} tokens at {m.decode_tok_s:.1f} tok/s | peak memory {_gib(m.peak_memory_bytes)} "
          f"({engine.device.type})", file=sys.stderr)
    _report_stats(engine, args)
    return 0


def _report_stats(engine, args) -> None:
    if getattr(args, "stats", False):
        print(_stats_text(engine), file=sys.stderr)
    if getattr(args, "stats_json", None):
        _write_json(Path(args.stats_json), engine.stats())


def _stats_text(engine) -> str:
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


def cmd_serve(args) -> int:
    """Load in the background behind a listening server (/health answers 503 until ready)."""
    import ipaddress
    import logging

    import uvicorn

    from moestream.serve.app import ServeOptions, create_app

    config = engine_config(args)
    config.runtime.max_batch = args.max_batch
    config.runtime.kv_rows = args.max_batch
    config.runtime.prefix_cache_memory = args.prefix_cache_memory
    if args.warmup_tokens is None:   # compile kernels and capture graphs before the first request
        config.warm_start.warmup_tokens = 8
    config.validate()
    name = args.served_model_name or Path(config.model).name or str(config.model)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="[moestream] %(message)s")
    try:
        exposed = not ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        exposed = args.host != "localhost"
    if exposed and args.api_key is None:
        print(f"[moestream] warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    server: uvicorn.Server | None = None

    def load():
        import moestream

        t0 = time.perf_counter()
        try:
            if config.quant.quantized:
                print("[moestream] quantizing on load (a slower start; `moestream convert` once to skip this)", file=sys.stderr)
            engine = moestream.load(config)
            if engine.tokenizer is None:
                print(f"[moestream] warning: {config.model} has no tokenizer files; only /v1/completions with token-id "
                      "prompts will work", file=sys.stderr)
            elif not getattr(engine.tokenizer, "chat_template", None):
                print("[moestream] warning: this checkpoint has no chat template; using ChatML with Qwen3-style tools",
                      file=sys.stderr)
            if args.verbose:
                print(engine.plan.memory.explain(), file=sys.stderr)
            print(f"[moestream] serving {name} on http://{args.host}:{args.port} (loaded in "
                  f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr)
            return engine
        except BaseException:
            if server is not None:
                server.should_exit = True
            raise

    options = ServeOptions(model_name=name, api_key=args.api_key, max_queue=args.max_queue)
    app = create_app(load, options)
    class GracefulServer(uvicorn.Server):
        """Uvicorn re-raises SIGTERM / SIGINT once it has shut down gracefully, so the process would die of
        the signal; a clean shutdown exits 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    server.run()
    error = app.state.status["error"]
    if error is not None:
        raise error if isinstance(error, MoestreamError) else InputError(f"loading failed: {error}")
    return 0


def _write_json(path: Path, data) -> None:
    from moestream.fileio import write_json_atomic

    write_json_atomic(path, data, indent=2)


def cmd_bench(args) -> int:
    from moestream.bench import run_bench

    check_output(args.json, "--json")
    trace = None
    if args.routing_trace is not None:
        from moestream.warmstart.trace import RoutingTrace

        if args.routing == "uniform":
            raise InputError("give either --routing uniform or --routing-trace, not both.")
        trace = RoutingTrace.load(args.routing_trace)   # a bad trace fails before the weights load
    engine, load_s = _load(args)
    routing = None
    if args.routing == "uniform" or trace is not None:
        from moestream.bench import TraceRouting, UniformRouting, use_routing

        routing = (UniformRouting(engine.config.top_k, engine.device) if trace is None else TraceRouting.for_engine(trace, engine))
        use_routing(engine, routing)
    result = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s, seed=args.seed,
                       temperature=args.temperature, routing=routing)
    print(result.table())
    if args.stats:
        print(_stats_text(engine))
    if args.json:
        _write_json(Path(args.json), {**result.as_dict(), "stats": engine.stats()})
    return 0


def _read_profile_prompts(args, engine) -> list[str | list[int]]:
    """One prompt per non-empty line, or the whole file cut into --chunk-tokens pieces. Without a
    tokenizer, the file holds space-separated token ids."""
    path = Path(args.prompts)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"--prompts {path} does not exist; give a text file with one prompt per line.") from None
    except (OSError, UnicodeDecodeError):
        raise InputError(f"--prompts {path} cannot be read as UTF-8 text; give a text file with one prompt per line.") from None

    def ids_of(chunk: str) -> list[int]:
        return parse_token_ids(chunk, f"--prompts {path}")

    if args.chunk_tokens is not None:
        if not 1 <= args.chunk_tokens < engine.max_context:
            raise InputError(f"--chunk-tokens must be in 1..{engine.max_context - 1} (the context holds {engine.max_context}).")
        if engine.tokenizer is None:
            ids = ids_of(text)
        else:
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()   # a file longer than the context is the point: no length warning
            try:
                ids = engine.tokenizer(text, add_special_tokens=False).input_ids
            finally:
                hf_logging.set_verbosity(verbosity)
        prompts = [ids[i:i + args.chunk_tokens] for i in range(0, len(ids), args.chunk_tokens)]
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        prompts = [ids_of(line) for line in lines] if engine.tokenizer is None else lines
    if args.max_prompts is not None:
        prompts = prompts[:args.max_prompts]
    if not prompts:
        raise InputError(f"--prompts {path} holds no prompts; give a text file with one prompt per line.")
    return prompts


def cmd_profile(args) -> int:
    """Record which experts the prompts use (and optionally the full routing trace)."""
    from moestream.warmstart.trace import record_profile_and_trace

    if args.max_tokens < 0:
        raise InputError("--max-tokens must be 0 or more.")
    if not Path(args.prompts).is_file():
        raise InputError(f"--prompts {args.prompts} does not exist; give a text file with one prompt per line.")
    for flag, out in (("--out", args.out), ("--trace", args.trace)):
        check_output(out, flag)
    engine, load_s = _load(args)
    prompts = _read_profile_prompts(args, engine)
    t0 = time.perf_counter()
    profile, trace = record_profile_and_trace(engine, prompts, args.max_tokens, trace=args.trace is not None)
    seconds = time.perf_counter() - t0
    profile.save(args.out)
    print(profile.summary())
    print(f"profile written to {args.out}")
    if trace is not None:
        trace.save(args.trace)
        print(f"routing trace of {trace.tokens} tokens written to {args.trace}")
    print(f"[moestream] load {load_s:.2f} s | recorded {profile.tokens} tokens in {seconds:.2f} s", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    """The memory plan for a checkpoint and budget, from config.json alone (no weights read)."""
    from moestream.engine.plan import plan_load

    cfg = engine_config(args)
    if cfg.runtime.devices:   # one plan per rank: each holds its share of the experts, sized by its budget
        from moestream.engine.ranks import explain_ranks, plan_ranks

        plans = plan_ranks(cfg)
        _print_model(plans[0].plan)
        print()
        print(explain_ranks(plans))
        return 0
    plan = plan_load(cfg)
    _print_model(plan)
    print(plan.memory.explain())
    _print_cpu_path()
    if args.measure_costs:
        _print_miss_costs(plan)
    return 0


def _print_cpu_path() -> None:
    """What `--cpu-misses` would compute with on this host: the inputs its split starts from."""
    from moestream.kernels import cpu_moe

    cpus = len(cpu_moe.usable_cpus())
    if cpu_moe.load() is None:
        print(f"CPU experts       plain torch ({cpu_moe.unavailable_reason()}); --cpu-misses would be slow here")
    else:
        print(f"CPU experts       C kernel, {cpu_moe.default_threads(cpus)} of {cpus} cores by default (--cpu-threads); "
              f"--cpu-misses auto measures copy and CPU costs at the first decode step (--stats prints them; "
              f"--measure-costs here times them now)")


def _print_miss_costs(plan) -> None:
    """The hybrid split's inputs (`MissCosts`), measured now on random experts of this model's shape
    and format in host RAM (pinned where a GPU can copy them): what `--cpu-misses auto` measures at
    its first decode step, here before any weight is read."""
    import torch

    from moestream.experts.fetch import MissCosts
    from moestream.experts.format import ExpertShape
    from moestream.kernels import cpu_moe

    fmt = next(iter(plan.expert_formats.values()), None)
    if fmt is None:
        print("miss costs        none: the model has no routed experts")
        return
    shape = ExpertShape.of(plan.config)
    nbytes = fmt.nbytes(shape)
    pin = plan.device.type == "cuda"
    # Up to 1 GiB of experts, more than a server's last-level cache, so every timed read is DRAM's.
    count = max(8, min(128, (1 << 30) // max(nbytes, 1)))
    g = torch.Generator().manual_seed(0)
    stack = {}
    for t in fmt.tensors(shape):
        if t.dtype.is_floating_point:
            data = (torch.randn((count, *t.shape), generator=g) * 0.02).to(t.dtype)
        else:
            data = torch.randint(0, 256, (count, *t.shape), generator=g, dtype=torch.uint8).view(t.dtype)
        stack[t.name] = data.pin_memory() if pin else data
    costs = MissCosts.measure(stack, fmt.host_dispatch(shape), plan.device, shape.hidden, fmt.dtype)
    threads = cpu_moe.default_threads(len(cpu_moe.usable_cpus()))
    print(f"miss costs        one {fmt.name} expert ({nbytes / 1e6:.2f} MB), measured now on {count} random experts:")
    if pin:
        print(f"  copy over PCIe  {costs.copy_s * 1e6:.0f} us ({nbytes / costs.copy_s / 1e9:.1f} GB/s)")
    print(f"  on the CPU      {costs.cpu_expert_s * 1e6:.0f} us for its first token ({nbytes / costs.cpu_expert_s / 1e9:.1f} "
          f"GB/s of weights, {threads} threads), +{costs.cpu_token_s * 1e6:.1f} us per further token")
    print(f"  CPU call        {costs.cpu_call_s * 1e6:.0f} us fixed (hidden rows to the host, the result back)")
    if pin:
        print(f"  both at once    {costs.contention:.2f}x the slower alone (both read host RAM)")


def _print_model(plan) -> None:
    config = plan.config
    print(f"model             {plan.folder} ({plan.spec.name}, {config.num_layers} layers, {config.num_experts} experts, top-{config.top_k})")
    print(f"device            {plan.device} ({str(plan.dtype).replace('torch.', '')}), context {plan.context}")
    if plan.kind == "fp8":
        print(f"experts           {plan.fp8.name}, kept as stored (a byte a weight + float32 block scales), "
              "and so are the dense FP8 linears")


def cmd_convert(args) -> int:
    from moestream.convert import convert
    from moestream.sizes import format_bytes

    result = convert(args.source, args.out, _recipe(args), dtype=args.dtype, device=args.device, force=args.force,
                     progress=sys.stderr.isatty())
    resumed = f", resumed after {result.resumed_layers} finished layers" if result.resumed_layers else ""
    print(f"[moestream] wrote {result.out} ({format_bytes(result.written_bytes)}) in {result.seconds:.1f} s, "
          f"{result.gb_per_s:.2f} GB/s of expert weights{resumed}", file=sys.stderr)
    return 0


def cmd_archs(args) -> int:
    from moestream.archs import describe_archs

    rows = describe_archs()
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    print("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))
    return 0


def cmd_perplexity(args) -> int:
    from moestream.runtime.perplexity import sliding_window_scores

    path = Path(args.file)
    if not path.is_file():
        raise InputError(f"--file {path} does not exist; give a text or code file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--file {path} is not UTF-8 text; give a text or code file.") from None
    engine, _ = _load(args)
    if engine.tokenizer is None:
        raise InputError("this checkpoint has no tokenizer files, so a text file cannot be scored.")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # a file longer than the context is the point here: no length warning
    try:
        ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    finally:
        hf_logging.set_verbosity(verbosity)
    if len(ids) < 2:
        raise InputError(f"--file {path} holds fewer than two tokens; give a longer file.")
    window = min(args.window or engine.max_context, engine.max_context)
    t0 = time.perf_counter()
    kl = None
    if args.decode:
        from moestream.runtime.perplexity import decode_perplexity

        if args.kl_reference is not None:
            raise InputError("--kl-reference scores prompt windows; run it without --decode.")
        ppl, n = decode_perplexity(engine, ids, window, args.max_tokens)
    else:
        reference = _kl_reference(args, engine) if args.kl_reference is not None else None
        scores = sliding_window_scores(engine.logits, ids, window, engine.device,
                                       reference.logits if reference is not None else None)
        ppl, n, kl = scores.perplexity, scores.tokens, scores.kl
    result = {"perplexity": ppl, "tokens": n, "window": window, "seconds": time.perf_counter() - t0,
              "mode": "decode" if args.decode else "prefill", "miss_policy": engine.bank.miss_policy,
              "capacity": engine.bank.capacity, "experts": engine.bank.formats[next(iter(engine.bank.formats))].name
              if engine.bank.formats else None, "kl_to_reference": kl}
    extra = f", KL to the reference {kl:.5f} nats/token" if kl is not None else ""
    print(json.dumps(result) if args.json else
          f"perplexity {ppl:.4f} over {n} tokens (window {window}, {result['mode']}, {engine.bank.miss_policy}, "
          f"capacity {engine.bank.capacity}/{engine.config.num_experts}{extra})")
    return 0


def _kl_reference(args, engine):
    """The reference of --kl-reference: another checkpoint, or this one at full precision (no recipe)."""
    import moestream
    from moestream.engine import EngineConfig, RuntimeConfig

    model = str(engine.folder) if args.kl_reference == "same" else args.kl_reference
    return moestream.load(EngineConfig(model, RuntimeConfig(device=str(engine.device), dtype=engine.dtype,
                                                            max_context=args.max_context)))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moestream", description="Run Mixture-of-Experts models larger than the accelerator.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = sub.add_parser("run", help="generate text from a prompt, streaming to stdout")
    _add_load_args(run)
    run.add_argument("-p", "--prompt", help="prompt text (default: read stdin)")
    run.add_argument("--max-tokens", type=integer(1), default=128)
    run.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy")
    run.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0)
    run.add_argument("--top-k", type=integer(0), default=0)
    run.add_argument("--min-p", type=number(0, 1, high_open=True), default=0.0)
    run.add_argument("--seed", type=integer(-2**63, 2**64 - 1), default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    run.add_argument("--stats", action="store_true", help="print the bank's hit/miss table to stderr")
    run.add_argument("--stats-json", default=None, help="write the bank's statistics as JSON to this file")
    _add_profile_args(run)
    run.set_defaults(func=cmd_run)

    ppl = sub.add_parser("perplexity", help="sliding-window perplexity of a text file")
    _add_load_args(ppl)
    ppl.add_argument("--file", required=True, help="text or code file to score")
    ppl.add_argument("--window", type=integer(2), default=None, help="window length (default: the context)")
    ppl.add_argument("--json", action="store_true")
    ppl.add_argument("--decode", action="store_true",
                     help="score every token through a decode step (what decode-only approximations such as --miss-policy skip change)")
    ppl.add_argument("--max-tokens", type=integer(1), default=None, help="with --decode: score at most this many tokens")
    ppl.add_argument("--kl-reference", nargs="?", const="same", default=None, metavar="MODEL",
                     help="also report the mean KL divergence to a reference's next-token distributions "
                          "(default: this checkpoint at full precision)")
    _add_profile_args(ppl)
    ppl.set_defaults(func=cmd_perplexity)

    bench = sub.add_parser("bench", help="measure TTFT, prefill and decode speed, hit rate and bytes moved")
    _add_load_args(bench)
    bench.add_argument("--prompt-tokens", type=integer(1), default=512)
    bench.add_argument("--gen-tokens", type=integer(1), default=128)
    bench.add_argument("--seed", type=integer(0, 2**63 - 1), default=0)
    bench.add_argument("--temperature", type=number(0), default=0.0,
                       help="sample the decoded tokens (seeded); use 1.0 on random-weight checkpoints for near-uniform routing")
    bench.add_argument("--routing", choices=["model", "uniform"], default="model",
                       help="uniform: replace the model's expert choice by uniform random experts (worst case for the bank; labelled)")
    bench.add_argument("--stats", action="store_true", help="also print the per-layer table")
    bench.add_argument("--json", default=None, help="write the results as JSON to this file")
    bench.add_argument("--routing-trace", default=None,
                       help="replay the expert choices of a routing trace from `moestream profile --trace` (labelled)")
    _add_profile_args(bench)
    bench.set_defaults(func=cmd_bench)

    prof = sub.add_parser("profile", help="record how often each expert is used on your prompts (a profile for --profile)")
    _add_load_args(prof)
    prof.add_argument("--prompts", required=True, help="text file: one prompt per line (or see --chunk-tokens)")
    prof.add_argument("--out", required=True, help="where to write the profile JSON")
    prof.add_argument("--max-tokens", type=integer(0), default=0, help="greedy tokens to decode after each prompt (default 0: prompts only)")
    prof.add_argument("--chunk-tokens", type=integer(1), default=None, help="cut the whole file into prompts of this many tokens instead of lines")
    prof.add_argument("--max-prompts", type=integer(1), default=None, help="use at most this many prompts")
    prof.add_argument("--trace", default=None, help="also write the routing trace (expert ids per token and layer) for `bench --routing-trace`")
    prof.set_defaults(func=cmd_profile)

    check = sub.add_parser("check", help="show the memory plan for a budget without loading weights")
    check.add_argument("model", nargs="?", help="checkpoint folder or hub id (default: the bundled demo model)")
    check.add_argument("--device", default="auto")
    _add_devices_args(check, "; one plan per rank")
    check.add_argument("--dtype", default="auto")
    check.add_argument("--max-context", type=integer(2), default=None)
    _add_kv_args(check)
    _add_budget_args(check)
    _add_quant_args(check)
    check.add_argument("--measure-costs", action="store_true",
                       help="also time what a miss costs on this machine (copy over PCIe, an expert on the CPU) on "
                            "random experts of the model's shape: the inputs of --cpu-misses auto's split")
    check.set_defaults(func=cmd_check)

    conv = sub.add_parser("convert", help="write a packed checkpoint with quantized experts (and dense tensors)")
    conv.add_argument("source", help="Hugging Face checkpoint folder or hub id (bf16/fp16/fp32)")
    conv.add_argument("out", help="output folder (written beside as .OUT.partial, renamed when complete)")
    _add_quant_args(conv, "required")
    conv.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                      help="dtype of the tensors kept at full precision (default: the source's)")
    conv.add_argument("--device", default="auto", help="where to quantize: cpu, cuda or auto")
    conv.add_argument("--force", action="store_true", help="overwrite an existing output folder")
    conv.set_defaults(func=cmd_convert)

    archs = sub.add_parser("archs", help="list supported model families")
    archs.set_defaults(func=cmd_archs)

    serve = sub.add_parser("serve", help="an OpenAI (Chat, Completions, Responses) and Anthropic (Messages) compatible server")
    _add_load_args(serve)
    _add_profile_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=integer(0, 65535), default=8080)
    serve.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY or x-api-key: KEY)")
    serve.add_argument("--max-batch", type=integer(1), default=8,
                       help="sequences decoded together (without --kv-cache-memory the cache is sized for this many "
                            "full contexts)")
    serve.add_argument("--max-queue", type=integer(1), default=256, help="requests waiting for a batch place before 429")
    serve.add_argument("--prefix-cache-memory", default="1GiB",
                       help="device memory for finished conversations' KV, reused by prompts that extend them (0 = off; "
                            "a paged cache adds it to its blocks, which sequences and cached prefixes share)")
    serve.add_argument("--served-model-name", default=None, help="the model name reported to clients (default: the folder name)")
    serve.add_argument("--shutdown-timeout", type=integer(0), default=10,
                       help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C")
    serve.set_defaults(func=cmd_serve)
    return parser


class _Interrupts:
    """Ctrl-C raises KeyboardInterrupt as usual, and is also remembered: a library that swallows the
    exception (some do, during their imports) cannot lose it, the next check raises it again. One
    raised inside a finalizer (`__del__`) cannot propagate, CPython reports it as "unraisable" with a
    traceback; that report is silenced, since the remembered interrupt ends the run anyway."""

    def __init__(self):
        self.seen = False

    def install(self) -> None:
        import signal

        def handler(signum, frame):
            self.seen = True
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, handler)
        report = sys.unraisablehook

        def unraisable(info) -> None:
            if not (self.seen and isinstance(info.exc_value, KeyboardInterrupt)):
                report(info)
        sys.unraisablehook = unraisable

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


_interrupts = _Interrupts()


def _exit_now(code: int) -> None:
    """Flush what was written and end the process (nothing of ours is left half-written by then:
    files are written through temporaries that failures remove)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _quiet_libraries() -> None:
    """Library warnings (torch, transformers) would reach stderr before our own one-line messages;
    --verbose keeps them."""
    import warnings

    warnings.simplefilter("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    """Parse, run, and turn every failure into one line: MoestreamError exits 1, Ctrl-C exits 130
    at any point (imports of torch and transformers included: they happen in here)."""
    try:
        if argv is None:   # the process's own command line: own its Ctrl-C
            _interrupts.install()
        args = build_parser().parse_args(argv)
        if not getattr(args, "verbose", False):
            _quiet_libraries()
        launched = _torchrun()
        if launched is not None and launched.rank != 0 and args.command in ("run", "serve", "bench", "profile", "perplexity"):
            return _follow_rank_0(launched)
        return args.func(args)
    except MoestreamError as exc:
        print(f"moestream: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        if argv is None:   # the process's own Ctrl-C: leave now, with 130 (a library that already saw
            _exit_now(130)  # the interrupt can otherwise make the interpreter re-raise it at shutdown)
        return 130
    except BrokenPipeError:   # the reader went away (e.g. `| head`): not an error of ours
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return 0
    except Exception:
        # A Ctrl-C that landed inside a library's import can leave that library half-initialised, so
        # the failure surfaces as some other exception (numpy's lazy submodules recurse forever): once
        # an interrupt was seen, whatever follows is that interrupt.
        if not _interrupts.seen:
            raise
        print("moestream: interrupted", file=sys.stderr)
        if argv is None:
            _exit_now(130)
        return 130


if __name__ == "__main__":
    sys.exit(main())
