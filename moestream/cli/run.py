"""`moestream run`: generate from a prompt, streaming the text to stdout."""

from __future__ import annotations

import argparse
import sys

from moestream.checkpoint.resolve import has_tokenizer, local_checkpoint
from moestream.cli.common import (check_chat_template, check_output, checked_model, load_engine, parse_token_ids,
                                  report_stats)
from moestream.cli.flags import add_json_arg, add_load_args, add_profile_args, integer, number
from moestream.cli.interrupts import interrupts
from moestream.errors import InputError


def add_parser(sub) -> None:
    run_p = sub.add_parser("run", help="generate text from a prompt, streaming to stdout")
    add_load_args(run_p)
    run_p.add_argument("-p", "--prompt", help="prompt text (default: read stdin)")
    run_p.add_argument("--max-tokens", type=integer(1), default=128, help="tokens to generate at most (default 128)")
    run_p.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy (default 0)")
    run_p.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0,
                       help="sample from the smallest set of tokens whose probabilities reach P (default 1: all)")
    run_p.add_argument("--top-k", type=integer(0), default=0, help="sample from the K likeliest tokens (default 0: all)")
    run_p.add_argument("--min-p", type=number(0, 1, high_open=True), default=0.0,
                       help="drop tokens less likely than P times the likeliest (default 0: none)")
    run_p.add_argument("--seed", type=integer(-2**63, 2**64 - 1), default=None,
                       help="seed of the sampling (default: a fresh one each run)")
    run_p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run_p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    run_p.add_argument("--stats", action="store_true", help="print the bank's hit/miss table to stderr")
    add_json_arg(run_p, "the bank's statistics (after the text on stdout)")
    run_p.add_argument("--stats-json", dest="json", default=None, help=argparse.SUPPRESS)   # the older name of --json
    add_profile_args(run_p)
    run_p.set_defaults(func=run)


def read_prompt(args) -> str:
    """The prompt from -p or stdin, as text: bytes that are not UTF-8 become U+FFFD, never an error."""
    if args.prompt is not None:   # argv bytes that were not UTF-8 arrive as surrogates
        if not args.prompt:
            raise InputError("the prompt is empty (-p \"\"); give some text, or leave -p out and pipe a prompt on stdin.")
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
    check_output(args.json, "--json")
    model = checked_model(args)
    folder = local_checkpoint(model)
    if args.chat:
        check_chat_template(model)
    elif folder is not None and not has_tokenizer(folder):
        parse_token_ids(prompt, "the prompt")   # a bad id is named before the load
    engine, load_s = load_engine(args)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, seed=args.seed, stop=args.stop, chat=args.chat)
    out = sys.stdout
    if engine.tokenizer is None:
        if args.chat:
            raise InputError("--chat needs the checkpoint's tokenizer and chat template, and this checkpoint has no "
                             "tokenizer files; run without --chat and pass token ids.")
        ids = parse_token_ids(prompt, "the prompt")
        pieces = (f"{token} " for token in engine.stream_tokens(ids, **{k: v for k, v in kw.items() if k != "chat"}))
    else:
        pieces = engine.stream(prompt, **kw)
    written = False
    try:
        for piece in pieces:
            interrupts.check()
            out.write(piece)
            out.flush()
            written = written or bool(piece)
    except KeyboardInterrupt:
        if written:   # end the text's line: "moestream: interrupted" goes on its own
            out.write("\n")
            out.flush()
        raise
    out.write("\n")
    m = engine.last_metrics
    print(f"[moestream] load {load_s:.2f} s | prompt {m.prompt_tokens} tokens | TTFT {m.ttft_s * 1000:.0f} ms | "
          f"generated {m.generated_tokens} tokens at {m.decode_tok_s:.1f} tok/s | peak memory {gib(m.peak_memory_bytes)} "
          f"({engine.device.type})", file=sys.stderr)
    report_stats(engine, args, run={"load_s": load_s, "prompt_tokens": m.prompt_tokens, "ttft_s": m.ttft_s,
                                    "generated_tokens": m.generated_tokens, "decode_tok_s": m.decode_tok_s,
                                    "peak_memory_bytes": m.peak_memory_bytes, "device": engine.device.type})
    return 0

