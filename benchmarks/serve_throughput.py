"""Served decode throughput and latency at several concurrent streams, and an agent's second turn.

Starts `moestream serve`'s app in a process of its own on a checkpoint (a random full-size one
written when missing, or any folder), then drives it over HTTP the way clients do:

* N concurrent streams (default 1, 4, 16, 64), each a `/v1/completions` request of random prompt
  token ids, `--gen-tokens` generated with `ignore_eos`, streamed: aggregate decode tok/s (tokens
  after each stream's first, over the span from the first first-token to the last token), p50 /
  p99 inter-token latency and time to first token. Each N is measured after one unmeasured round
  of N shorter streams (steady state: kernels compiled for these shapes, either server's buffers
  grown); our server starts as `moestream serve` does, its decode graphs captured at start-up;
* an agent-like second turn: a `--prefix-tokens` prompt, then the same prompt plus `--new-tokens`
  new ones: time to first token with the prefix cache, and cold (a new prompt of the same length).

With `--llama-server BIN --gguf FILE` the same requests go to llama.cpp's server (started with
`-np N` parallel slots, `--n-cpu-moe` from `--peer-n-cpu-moe`) in the same run; its `/completion`
endpoint takes the same token ids (`cache_prompt: true` for the second turn).

Routing (`--routing`, default uniform) is stated in the result: random weights route nearly the
same experts for every token, so the bank is measured under uniform synthetic routing or a
replayed trace of the demo model's routing.

    python benchmarks/serve_throughput.py --ckpt /tmp/q3 --out /tmp/serve --capacity 32 --routing uniform \\
        [--llama-server $B/llama-server --gguf /tmp/q3.gguf --peer-n-cpu-moe 18]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import checkpoint_args, ensure_checkpoint, log, model_config  # noqa: E402
from moestream.bench import apply_routing  # noqa: E402
from moestream.cli.flags import chunk_tokens, share_or_auto  # noqa: E402
from moestream.fileio import write_json_atomic  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 1200, proc: subprocess.Popen | None = None) -> None:
    """Wait for `url`'s /health; a server process (`proc`) that exits first ends the wait with its code."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy")
        time.sleep(0.5)


# ---- one streamed request: the arrival time of each token -------------------------------------

# Every request samples at temperature 1: a random model's greedy tokens repeat a few ids, and on a
# token-routed file (random_gguf.py / make_random_checkpoint.py --token-routing) llama.cpp's routing,
# and ours with --routing model, follows the tokens: sampled tokens keep both near-uniform.
TEMPERATURE = 1.0

def stream_ours(url: str, prompt: list[int], tokens: int, extra: dict | None = None, on_event=None) -> list[float]:
    """`extra`: more request fields; `on_event`: called with every streamed JSON object."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": TEMPERATURE, "ignore_eos": True, "stream": True,
            **(extra or {})}
    return _stream(f"{url}/v1/completions", body, lambda d: d.get("choices") and d["choices"][0].get("finish_reason") is None,
                   on_event)


def stream_llama(url: str, prompt: list[int], tokens: int, extra: dict | None = None, on_event=None) -> list[float]:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": TEMPERATURE, "ignore_eos": True, "stream": True,
            "cache_prompt": True, **(extra or {})}
    return _stream(f"{url}/completion", body, lambda d: not d.get("stop"), on_event)


_CLIENT: httpx.Client | None = None


def _client() -> httpx.Client:
    """One client, its connections kept, for every request of both servers: a new client per request
    would add ~20 ms of its own set-up to every time to first token."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=None, max_keepalive_connections=128))
    return _CLIENT


def _stream(endpoint: str, body: dict, is_token, on_event=None) -> list[float]:
    arrivals = []
    with _client().stream("POST", endpoint, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if is_token(data):
                arrivals.append(time.perf_counter())
            if on_event is not None:
                on_event(data)
    return arrivals


def concurrent_streams(send, url: str, streams: int, prompt_tokens: int, gen_tokens: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_tokens)] for _ in range(streams)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(lambda p: send(url, p, gen_tokens), prompts))
    firsts = [r[0] for r in runs if r]
    gaps = [b - a for r in runs for a, b in zip(r, r[1:])]
    after_first = sum(max(len(r) - 1, 0) for r in runs)
    span = max(r[-1] for r in runs if r) - min(firsts)
    return {"streams": streams, "tokens": sum(len(r) for r in runs),
            "aggregate_decode_tok_s": after_first / span if span > 0 else 0.0,
            "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
            "itl_p99_ms": 1000 * statistics.quantiles(gaps, n=100)[98] if len(gaps) >= 100 else None,
            "ttft_p50_ms": 1000 * statistics.median(f - t0 for f in firsts)}


def measured_streams(send, url: str, streams: int, args, vocab: int) -> dict:
    """One unmeasured round of `streams` shorter streams, then the measured round (with our server's
    engine steps during it: `steps`)."""
    concurrent_streams(send, url, streams, args.prompt_tokens, 16, vocab, seed=10_000 + streams)
    before = step_histogram(url)
    result = concurrent_streams(send, url, streams, args.prompt_tokens, args.gen_tokens, vocab, seed=streams)
    after = step_histogram(url)
    if after:
        result["steps"] = {kind: {"count": int(after[kind]["count"] - before.get(kind, {}).get("count", 0)),
                                  "seconds": after[kind]["sum"] - before.get(kind, {}).get("sum", 0.0),
                                  "over_1s": int(after[kind]["over_1s"] - before.get(kind, {}).get("over_1s", 0))}
                           for kind in after}
    return result


def step_histogram(url: str) -> dict[str, dict[str, float]]:
    """Our server's engine steps so far by kind (prompt / decode): count, summed seconds, and steps over a
    second (`moestream_step_seconds`); {} from a server without them (llama-server)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        answer = _client().get(f"{url}/metrics")
    except httpx.HTTPError:
        return {}
    if answer.status_code != 200:
        return {}
    steps: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(answer.text):
        if family.name != "moestream_step_seconds":
            continue
        for sample in family.samples:
            entry = steps.setdefault(sample.labels["kind"], {"count": 0.0, "sum": 0.0, "at_most_1s": 0.0})
            if sample.name.endswith("_count"):
                entry["count"] = sample.value
            elif sample.name.endswith("_sum"):
                entry["sum"] = sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == 1.0:
                entry["at_most_1s"] = sample.value
    for entry in steps.values():
        entry["over_1s"] = entry["count"] - entry.pop("at_most_1s")
    return steps


def second_turn(send, url: str, prefix_tokens: int, new_tokens: int, vocab: int) -> dict:
    rng = random.Random(7)
    # A throwaway conversation of the same lengths first: kernels compiled and attention plans built
    # for these shapes are start-up costs, not the second turn's.
    spare = [rng.randrange(1, vocab) for _ in range(prefix_tokens + new_tokens)]
    send(url, spare[:prefix_tokens], 2)
    send(url, spare, 1)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_tokens)]
    turn = prefix + [rng.randrange(1, vocab) for _ in range(new_tokens)]
    send(url, prefix, 2)                       # the first turn: its KV goes to the cache
    t0 = time.perf_counter()
    warm = send(url, turn, 1)[0] - t0
    turn = [rng.randrange(1, vocab) for _ in range(prefix_tokens + new_tokens)]   # cold: a prompt nobody sent
    t0 = time.perf_counter()
    cold = send(url, turn, 1)[0] - t0
    return {"prefix_tokens": prefix_tokens, "new_tokens": new_tokens, "ttft_cached_ms": 1000 * warm,
            "ttft_cold_ms": 1000 * cold}


# ---- the two servers --------------------------------------------------------------------------

def serve_ours(args, started: list | None = None) -> None:
    """The server process: load as `moestream serve` does, swap in the benchmark routing, serve
    (`started`: the uvicorn server is appended to it, so a caller in another thread can stop it)."""
    import uvicorn

    import moestream
    from moestream.serve.app import ServeOptions, create_app

    max_batch = max(args.streams, default=1)
    engine = moestream.load(str(args.ckpt), gpu_memory=args.gpu_memory, capacity=args.capacity, max_batch=max_batch,
                            kv_rows=max_batch, max_context=args.max_context,
                            prefix_cache_memory=args.prefix_cache_memory, kv_layout=args.kv_layout,
                            prefill_chunk=getattr(args, "prefill_chunk", "auto"),
                            pack_prompts=getattr(args, "pack_prompts", "on") == "on",
                            cpu_misses=getattr(args, "cpu_misses", None),
                            prompt_cpu_misses=getattr(args, "prompt_cpu_misses", 0.0))
    apply_routing(engine, args.routing, args.trace)
    engine.warm_up(8)   # as `moestream serve` starts: kernels compiled, every padded batch's graphs captured
    app = create_app(lambda: engine, ServeOptions(model_name="bench", max_queue=4 * max_batch))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.serve_port, log_level="warning"))
    if started is not None:
        started.append(server)
    server.run()


@contextmanager
def our_server(args, script: Path):
    """Our server in a process of its own (as `moestream serve` runs, and as llama-server does: the
    clients' threads never share its interpreter): `script` run again with this run's arguments and
    `--serve-port` (its main then calls `serve_ours`); yields its URL once healthy."""
    port = free_port()
    if args.server_thread:   # smoke runs: no second interpreter to start; the clients share the server's
        started: list = []
        thread = threading.Thread(target=serve_ours, args=(argparse.Namespace(**{**vars(args), "serve_port": port}),
                                                           started), daemon=True)
        thread.start()
        proc = None
    else:
        child = [a for a in sys.argv[1:] if a != "--peer-only"] + ["--serve-port", str(port), "--no-write"]
        proc = subprocess.Popen([sys.executable, str(Path(script).resolve()), *child])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc=proc)
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        else:
            for server in started:
                server.should_exit = True
            thread.join(60)


def server_stats(url: str) -> dict:
    """The bank's hit rate and the prefix cache's state, from `/v1/cache/stats`."""
    stats = httpx.get(f"{url}/v1/cache/stats", timeout=60).json()
    prefix = stats.get("prefix_cache") or {}
    return {"bank": stats["bank"]["hit_rate"], "bank_stats": stats["bank"],
            "kv_layout": "paged" if "blocks" in prefix else "rows", "prefix_cache": prefix}


def run_ours(args, ckpt: Path) -> dict:
    """Our server (`our_server`), driven over HTTP."""
    with our_server(args, Path(__file__)) as url:
        vocab = model_config(ckpt)["vocab_size"]
        rows = []
        for n in args.streams:
            rows.append(measured_streams(stream_ours, url, n, args, vocab))
            log("moestream", rows[-1])
        turn = None
        if args.prefix_tokens:
            turn = second_turn(stream_ours, url, args.prefix_tokens, args.new_tokens, vocab)
            log("moestream second turn", turn)
        return {"streams": rows, "second_turn": turn, **server_stats(url), "routing": args.routing,
                "capacity": args.capacity, "cpu_misses": args.cpu_misses, "prompt_cpu_misses": args.prompt_cpu_misses}


def run_llama(args, vocab: int) -> dict:
    rows = []
    for n in args.streams:
        port = free_port()
        ctx = n * (args.prompt_tokens + args.gen_tokens + 64)
        cmd = llama_command(args, port, ctx, n)
        rows.append(_with_llama(cmd, port, lambda url: measured_streams(stream_llama, url, n, args, vocab)))
        log("llama-server", rows[-1])
    turn = None
    if args.prefix_tokens:
        port = free_port()
        cmd = llama_command(args, port, 2 * (args.prefix_tokens + args.new_tokens) + 64, 1)
        turn = _with_llama(cmd, port, lambda url: second_turn(stream_llama, url, args.prefix_tokens, args.new_tokens,
                                                              vocab))
        log("llama-server second turn", turn)
    return {"streams": rows, "second_turn": turn, "n_cpu_moe": args.peer_n_cpu_moe}


def llama_command(args, port: int, ctx: int, slots: int) -> list[str]:
    """llama-server on the GGUF: all layers offloaded, `--n-cpu-moe` layers' experts kept on the CPU,
    `slots` parallel slots sharing a context of `ctx` positions."""
    return [args.llama_server, "-m", str(args.gguf), "-ngl", "99", "-fa", "on", "-c", str(ctx), "-np", str(slots),
            "--host", "127.0.0.1", "--port", str(port), "--n-cpu-moe", str(args.peer_n_cpu_moe)]


def _with_llama(cmd: list[str], port: int, work):
    log("$", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=600, proc=proc)
        return work(url)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = checkpoint_args(__doc__, run=False)
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--capacity", type=int, default=None, help="bank slots per layer (e.g. 32 of 128 = the 25%% budget)")
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16, 64], help="none: the second turn only")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--prefix-tokens", type=int, default=8192, help="0: no second turn")
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--max-context", type=int, default=8192 + 512)
    ap.add_argument("--prefix-cache-memory", default="4GiB")
    ap.add_argument("--kv-layout", choices=["auto", "paged", "rows"], default="auto")
    ap.add_argument("--prefill-chunk", type=chunk_tokens, default="auto",
                    help="our server's prompt tokens a forward (default auto, as `moestream serve`)")
    ap.add_argument("--pack-prompts", choices=["on", "off"], default="on",
                    help="our server: the prompts admitted in one step as one forward (off: one each, to compare)")
    ap.add_argument("--cpu-misses", type=share_or_auto, default=None, metavar="SHARE|auto",
                    help="our hybrid misses' CPU share (default: auto, moved while decoding; 1: the CPU takes every miss)")
    ap.add_argument("--prompt-cpu-misses", type=share_or_auto, default=0.0, metavar="SHARE|auto",
                    help="our server: a streamed prompt chunk's missing experts computed on the CPU (default 0: none)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary: measure it in the same run")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--peer-n-cpu-moe", type=int, default=0)
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default="uniform",
                    help="expert choice of our engine (llama.cpp follows the GGUF's own routers: write it with "
                         "random_gguf.py --token-routing so that they route near-uniformly)")
    ap.add_argument("--trace", type=Path, default=Path("benchmarks/traces/demo_heldout_trace.json"))
    ap.add_argument("--peer-only", action="store_true", help="measure llama-server only (ours in an earlier run)")
    ap.add_argument("--no-write", action="store_true", help="use --ckpt as it is (a folder with its own weights)")
    ap.add_argument("--server-thread", action="store_true",
                    help="run our server in a thread of this process, not a process of its own (smoke runs on a "
                         "CPU: one interpreter start; the clients then share its interpreter, so figures do not "
                         "compare with llama-server's)")
    ap.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)   # the server process
    args = ap.parse_args()
    if args.serve_port is not None:
        serve_ours(args)
        return
    if not args.no_write:
        ensure_checkpoint(args.ckpt, args.shape, args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}}
    if not args.peer_only:
        result["ours"] = run_ours(args, args.ckpt)
    if args.llama_server:
        vocab = model_config(args.ckpt)["vocab_size"]
        result["llama_server"] = run_llama(args, vocab)
    write_json_atomic(args.out / "serve_throughput.json", result, indent=2)
    log(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
