"""A coding agent's session as one benchmark: our server beside llama-server, turn by turn.

What a user of a coding agent (Claude Code, Codex, opencode) feels from `moestream serve` on a model
larger than the GPU:

1. the first turn: a long prompt (system prompt, tool schemas, files; `--first-tokens`, 16,384);
2. every later turn: the conversation so far (a cached prefix) plus `--new-tokens` new ones (300; a
   tool result, the user's next message) and a reply of `--gen-tokens` (200), `--turns` turns (20);
3. several such sessions at once (sub-agents, parallel tool calls): `--sessions 1 4`.

Each session's conversation grows exactly as an agent's does: turn t's prompt is turn t-1's prompt,
the tokens the server generated for it (returned as ids: `return_token_ids` on our `/v1/completions`,
`return_tokens` on llama-server's `/completion`) and the new tokens. The new tokens are the same
random ids for both servers (seeded per session); turns follow each other with no pause (the time a
tool takes to run is not modelled). Per turn: time to first token, decode tok/s (tokens after the
first over the time from the first to the last), the prompt's length and its cached part as the
server reports it, and for our server the kernel variants its process compiled during the turn (its
`/metrics`, read before and after the turn, outside its timing: a turn that compiled stalled); per session
its wall time. Before each session count, one unmeasured round of as
many 2-turn sessions (`--warm-turns`) compiles kernels and grows buffers for these shapes.

Our server runs `moestream serve`'s app in a process of its own (serve_throughput.py's), on a random
full-size checkpoint written when missing (`--no-write`: any folder), with `--routing` swapped into
its engine (uniform synthetic, or `trace` replay of the demo model's routing). With
`--llama-server BIN --gguf FILE` llama-server runs the same sessions in the same run, one process
per session count with `-np N` slots (session i pinned to slot i) and `--n-cpu-moe`
`--peer-n-cpu-moe`, each slot the context our server gets. Results: `agent_session.json` (routing,
machine, commands, every turn of both servers, per-session totals) and `agent_session.md` (the
headline rows, ours, llama-server's, ratio).

    python benchmarks/agent_session.py --ckpt /tmp/q3 --out /tmp/agent --capacity 32 --routing uniform \\
        [--llama-server $B/llama-server --gguf /tmp/q3.gguf --peer-n-cpu-moe 18]
    python benchmarks/agent_session.py --ckpt moestream/demo_model --no-write --out /tmp/agent --tiny  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import serve_throughput as st  # noqa: E402
from benchmarks.common import checkpoint_args, ensure_checkpoint, log, model_config  # noqa: E402
from benchmarks.headline_table import machine  # noqa: E402
from moestream.cli.flags import chunk_tokens  # noqa: E402
from moestream.fileio import write_bytes_atomic, write_json_atomic  # noqa: E402

MARGIN = 64   # context positions beyond the longest conversation


def context_tokens(args) -> int:
    """One session's context: the first turn, every later turn's new tokens, every reply, a margin."""
    return args.first_tokens + (args.turns - 1) * args.new_tokens + args.turns * args.gen_tokens + MARGIN


# ---- one turn, one session, N sessions -------------------------------------------------------------

def send_ours(url: str, prompt: list[int], tokens: int, slot: int) -> dict:
    """One streamed `/v1/completions` turn: arrival times, the generated ids and the cached prompt tokens."""
    ids: list[int] = []
    usage: dict = {}

    def seen(d: dict) -> None:
        for choice in d.get("choices") or []:
            ids.extend(choice.get("token_ids") or [])
        usage.update(d.get("usage") or {})

    arrivals = st.stream_ours(url, prompt, tokens, {"return_token_ids": True, "stream_options": {"include_usage": True}},
                              seen)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"arrivals": arrivals, "ids": ids, "cached": cached}


def send_llama(url: str, prompt: list[int], tokens: int, slot: int) -> dict:
    """One streamed `/completion` turn on slot `slot`, its prompt cache kept (`cache_prompt`)."""
    ids: list[int] = []
    timings: dict = {}

    def seen(d: dict) -> None:
        ids.extend(t for t in d.get("tokens") or [] if isinstance(t, int))
        timings.update(d.get("timings") or {})

    arrivals = st.stream_llama(url, prompt, tokens, {"return_tokens": True, "id_slot": slot}, seen)
    return {"arrivals": arrivals, "ids": ids, "cached": timings.get("cache_n")}


def compiled_in_server(url: str) -> int:
    """The Triton kernel variants our server's process has compiled (its `/metrics` gauge)."""
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("moestream_kernel_variants_compiled "):
            return int(float(line.split()[1]))
    raise RuntimeError("the server's /metrics has no moestream_kernel_variants_compiled")


def run_session(send, url: str, slot: int, args, vocab: int, seed: int, turns: int, keep_ids: bool,
                probe=None) -> dict:
    """One conversation of `turns` turns; each turn's prompt = the last prompt + its reply + new tokens.
    `probe(url)`: a count read before and after each turn, outside its timing (ours: kernels compiled)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, vocab) for _ in range(args.first_tokens)]
    rows, random_replies, reply = [], 0, []
    t_start = time.perf_counter()
    for turn in range(turns):
        if turn:
            prompt = prompt + reply + [rng.randrange(1, vocab) for _ in range(args.new_tokens)]
        before = probe(url) if probe is not None else None
        t0 = time.perf_counter()
        got = send(url, prompt, args.gen_tokens, slot)
        end = time.perf_counter()
        a = got["arrivals"]
        reply = got["ids"]
        # A streamed chunk carries text, and a token whose text is not complete yet (part of a UTF-8
        # character) sends none: so the ids, not the chunks, count the tokens when the server returns them.
        if not reply:   # the server gave no ids: one fresh id per chunk, said in the result
            random_replies += 1
            reply = [rng.randrange(1, vocab) for _ in a]
        row = {"turn": turn, "prompt_tokens": len(prompt), "cached_tokens": got["cached"], "generated": len(reply),
               "ttft_ms": 1000 * (a[0] - t0) if a else None,
               "decode_tok_s": (len(reply) - 1) / (a[-1] - a[0]) if len(a) > 1 and a[-1] > a[0] else None,
               "turn_ms": 1000 * (end - t0)}
        if probe is not None:   # with several sessions, any session's step may have compiled them
            row["kernels_compiled"] = probe(url) - before
        if keep_ids:
            row["prompt_ids"], row["generated_ids"] = list(prompt), list(reply)
        rows.append(row)
    return {"slot": slot, "wall_s": time.perf_counter() - t_start, "turns": rows,
            "replies": "random ids (the server returned none)" if random_replies else "the server's own tokens"}


def run_sessions(send, url: str, n: int, args, vocab: int, turns: int, seed: int, keep_ids: bool = False,
                 probe=None) -> dict:
    """`n` sessions at once, session i on slot i; each its own seeded conversation."""
    results: list = [None] * n

    def one(i: int) -> None:
        results[i] = run_session(send, url, i, args, vocab, seed + i, turns, keep_ids, probe)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in results):
        raise RuntimeError(f"a session of {n} failed (see the error above)")
    return {"sessions": n, "wall_s": time.perf_counter() - t0, "per_session": results}


def measured(send, url: str, n: int, args, vocab: int, probe=None) -> dict:
    """One unmeasured round of `n` short sessions (other ids), then the measured round."""
    if args.warm_turns:
        run_sessions(send, url, n, args, vocab, min(args.warm_turns, args.turns), seed=1_000_000 + 1000 * n)
    return run_sessions(send, url, n, args, vocab, args.turns, seed=1000 * n, keep_ids=args.keep_ids, probe=probe)


# ---- the two servers ---------------------------------------------------------------------------------

def server_args(args) -> argparse.Namespace:
    """serve_throughput's server options from ours: N sessions → N batch rows, one session's context."""
    return argparse.Namespace(**{**vars(args), "streams": args.sessions, "max_context": context_tokens(args)})


def run_ours(args, vocab: int) -> dict:
    with st.our_server(server_args(args), Path(__file__)) as url:
        runs = []
        for n in args.sessions:
            runs.append(measured(send_ours, url, n, args, vocab, probe=compiled_in_server))
            log("moestream", n, "sessions:", json.dumps(summary(runs[-1])))
        return {"runs": runs, **st.server_stats(url), "routing": args.routing, "capacity": args.capacity,
                "gpu_memory": args.gpu_memory}


def run_llama(args, vocab: int) -> dict:
    runs, commands = [], []
    for n in args.sessions:
        port = st.free_port()
        cmd = st.llama_command(args, port, n * context_tokens(args), n)   # -c is shared by the n slots
        commands.append(shlex.join(cmd))
        runs.append(st._with_llama(cmd, port, lambda url, n=n: measured(send_llama, url, n, args, vocab)))
        log("llama-server", n, "sessions:", json.dumps(summary(runs[-1])))
    return {"runs": runs, "commands": commands, "n_cpu_moe": args.peer_n_cpu_moe}


# ---- the headline ------------------------------------------------------------------------------------

def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summary(run: dict) -> dict:
    """The headline figures of one session count: means over its sessions (and their later turns)."""
    sessions = run["per_session"]
    return {"first_ttft_ms": _mean(s["turns"][0]["ttft_ms"] for s in sessions),
            "later_ttft_ms": _mean(t["ttft_ms"] for s in sessions for t in s["turns"][1:]),
            "decode_tok_s": _mean(t["decode_tok_s"] for s in sessions for t in s["turns"]),
            "session_wall_s": _mean(s["wall_s"] for s in sessions)}


# (key, label, unit, higher is better)
ROWS = [("first_ttft_ms", "first-turn TTFT", "ms", False), ("later_ttft_ms", "mean later-turn TTFT", "ms", False),
        ("decode_tok_s", "decode tok/s (per session)", "tok/s", True), ("session_wall_s", "session wall time", "s", False)]


def headline(result: dict, sessions: list[int]) -> list[dict]:
    """One row per figure and session count; ratio above 1: ours better (tok/s ours ÷ theirs, times theirs ÷ ours)."""
    ours = {r["sessions"]: summary(r) for r in (result.get("ours") or {}).get("runs", [])}
    peer = {r["sessions"]: summary(r) for r in (result.get("llama_server") or {}).get("runs", [])}
    rows = []
    for n in sessions:
        for key, label, unit, higher in ROWS:
            a, b = ours.get(n, {}).get(key), peer.get(n, {}).get(key)
            ratio = None if a is None or b is None or not a or not b else (a / b if higher else b / a)
            rows.append({"row": f"{label}, {n} session{'s' if n > 1 else ''}", "unit": unit, "ours": a,
                         "llama_server": b, "ratio": ratio})
    return rows


def table(result: dict) -> str:
    def cell(v, missing: str) -> str:
        return missing if v is None else f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"

    ours_missing = result.get("ours_not_run") or "not run"
    peer_missing = result.get("llama_server_not_run") or "failed"
    lines = [f"Agent session: {result['shape']}; routing {result['routing']}; {result['machine'].get('gpu')}", "",
             "| | unit | moestream | llama-server | ratio |", "|---|---|---|---|---|"]
    for r in result["headline"]:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['row']} | {r['unit']} | {cell(r['ours'], ours_missing)} | "
                     f"{cell(r['llama_server'], peer_missing)} | {ratio} |")
    return "\n".join(lines) + "\n\nRatio above 1: moestream better (tok/s ours / theirs; times theirs / ours).\n"


def main() -> None:
    ap = checkpoint_args(__doc__, run=False)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--first-tokens", type=int, default=16384, help="the first turn's prompt")
    ap.add_argument("--new-tokens", type=int, default=300, help="new prompt tokens of every later turn")
    ap.add_argument("--gen-tokens", type=int, default=200, help="tokens generated per turn")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4], help="concurrent session counts, one run each")
    ap.add_argument("--warm-turns", type=int, default=2, help="turns of the unmeasured round (0: none)")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--capacity", type=int, default=None, help="bank slots per layer (e.g. 32 of 128 = the 25%% budget)")
    ap.add_argument("--prefix-cache-memory", default="8GiB", help="our server's prefix cache")
    ap.add_argument("--kv-layout", choices=["auto", "paged", "rows"], default="auto")
    ap.add_argument("--prefill-chunk", type=chunk_tokens, default="auto",
                    help="our server's prompt tokens a forward (default auto, as `moestream serve`: a long first "
                         "turn at a bank runs faster in larger chunks)")
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default="uniform",
                    help="expert choice of our engine (llama.cpp follows the GGUF's own routers: write it with "
                         "random_gguf.py --token-routing so that they route near-uniformly)")
    ap.add_argument("--trace", type=Path, default=Path("benchmarks/traces/demo_heldout_trace.json"))
    ap.add_argument("--llama-server", default=None, help="llama-server binary: measure it in the same run")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--peer-n-cpu-moe", type=int, default=0)
    ap.add_argument("--peer-only", action="store_true", help="measure llama-server only")
    ap.add_argument("--no-write", action="store_true", help="use --ckpt as it is (a folder with its own weights)")
    ap.add_argument("--keep-ids", action="store_true", help="every turn's prompt and generated ids in the JSON")
    ap.add_argument("--server-thread", action="store_true",
                    help="our server in a thread of this process (smoke runs: the clients share its interpreter, "
                         "so figures do not compare with llama-server's)")
    ap.add_argument("--tiny", action="store_true",
                    help="a smoke run in seconds on a CPU: 3 turns of a few tokens, sessions 1 and 2, our server in a "
                         "thread, ids kept (a missing --ckpt is written in the tiny shape)")
    ap.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)   # the server process
    args = ap.parse_args()
    if args.serve_port is not None:
        st.serve_ours(server_args(args))
        return
    if args.tiny:
        given = {a.split("=")[0] for a in sys.argv[1:]}
        for flag, value in (("--turns", 3), ("--first-tokens", 40), ("--new-tokens", 6), ("--gen-tokens", 5),
                            ("--sessions", [1, 2]), ("--warm-turns", 1), ("--prefix-cache-memory", "64MiB")):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
        args.server_thread = args.keep_ids = True
    if min(args.turns, args.first_tokens, args.gen_tokens, *args.sessions) < 1 or args.new_tokens < 0:
        ap.error("--turns, --first-tokens, --gen-tokens and --sessions must be at least 1, --new-tokens at least 0")
    if args.llama_server and args.gguf is None:
        ap.error("--llama-server needs --gguf (the same model as a GGUF file)")
    if not args.no_write:
        ensure_checkpoint(args.ckpt, args.shape, args.layers, device="cpu" if args.tiny else "cuda", tiny=args.tiny)
    config = model_config(args.ckpt)
    vocab = config["vocab_size"]
    experts = next((config[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if config.get(k)), "?")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "shape": f"{args.ckpt.name}: {config.get('num_hidden_layers')} layers, {experts} experts",
        "routing": args.routing if args.routing != "trace" else f"trace {args.trace}",
        "machine": machine(),
        "turn_shape": {"first_tokens": args.first_tokens, "new_tokens": args.new_tokens, "gen_tokens": args.gen_tokens,
                       "turns": args.turns, "sessions": args.sessions, "context_per_session": context_tokens(args)},
        "commands": {"ours": shlex.join([sys.executable, *sys.argv])},
        "args": {k: str(v) for k, v in vars(args).items()}}
    if args.peer_only:
        result["ours_not_run"] = "not run (--peer-only)"
    else:
        result["ours"] = run_ours(args, vocab)
    if args.llama_server:
        try:
            result["llama_server"] = run_llama(args, vocab)
            result["commands"]["llama_server"] = result["llama_server"]["commands"]
        except Exception as exc:   # our figures stay; the peer's cells say why they are empty
            log(f"llama-server failed: {type(exc).__name__}: {exc}")
            result["llama_server_not_run"] = f"failed ({type(exc).__name__})"
    else:
        result["llama_server_not_run"] = "not run"
    result["headline"] = headline(result, args.sessions)
    write_json_atomic(args.out / "agent_session.json", result, indent=2)
    text = table(result)
    write_bytes_atomic(args.out / "agent_session.md", text.encode())
    log(text)


if __name__ == "__main__":
    main()
