"""`moestream run`: generate from a prompt, streaming the text to stdout."""

from __future__ import annotations

import sys

from moestream.cli.common import check_output, load_engine, parse_token_ids, report_stats
from moestream.cli.flags import add_load_args, add_profile_args, integer, number
from moestream.cli.interrupts import interrupts
from moestream.errors import InputError


def add_parser(sub) -> None:
    run_p = sub.add_parser("run", help="generate text from a prompt, streaming to stdout")
    add_load_args(run_p)
    run_p.add_argument("-p", "--prompt", help="prompt text (default: read stdin)")
    run_p.add_argument("--max-tokens", type=integer(1), default=128)
    run_p.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy")
    run_p.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0)
    run_p.add_argument("--top-k", type=integer(0), default=0)
    run_p.add_argument("--min-p", type=number(0, 1, high_open=True), default=0.0)
    run_p.add_argument("--seed", type=integer(-2**63, 2**64 - 1), default=None)
    run_p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run_p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    run_p.add_argument("--stats", action="store_true", help="print the bank's hit/miss table to stderr")
    run_p.add_argument("--stats-json", default=None, help="write the bank's statistics as JSON to this file")
    add_profile_args(run_p)
    run_p.set_defaults(func=run)


def read_prompt(args) -> str:
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


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(args) -> int:
    prompt = read_prompt(args)
    check_output(args.stats_json, "--stats-json")
    engine, load_s = load_engine(args)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, seed=args.seed, stop=args.stop, chat=args.chat)
    out = sys.stdout
    if engine.tokenizer is None:
        if args.chat:
            raise InputError("--chat needs the checkpoint's tokenizer and chat template, and this checkpoint has no "
                             "tokenizer files; run without --chat and pass token ids.")
        ids = parse_token_ids(prompt, "the prompt")
        for token in engine.stream_tokens(ids, **{k: v for k, v in kw.items() if k != "chat"}):
            interrupts.check()
            out.write(f"{token} ")
            out.flush()
    else:
        for piece in engine.stream(prompt, **kw):
            interrupts.check()
            out.write(piece)
            out.flush()
    out.write("\n")
    m = engine.last_metrics
    print(f"[moestream] load {load_s:.2f} s | prompt {m.prompt_tokens} tokens | TTFT {m.ttft_s * 1000:.0f} ms | "
          f"generated {m.generated_tokens} tokens at {m.decode_tok_s:.1f} tok/s | peak memory {gib(m.peak_memory_bytes)} "
          f"({engine.device.type})", file=sys.stderr)
    report_stats(engine, args)
    return 0

