"""`moestream profile`: how often each expert is used on the user's prompts (a profile for
--profile), and optionally the routing trace for `bench --routing-trace`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from moestream.cli.common import check_output, checked_model, load_engine, parse_token_ids
from moestream.cli.flags import add_load_args, integer
from moestream.errors import InputError


def add_parser(sub) -> None:
    prof = sub.add_parser("profile", help="record how often each expert is used on your prompts (a profile for --profile)")
    add_load_args(prof)
    prof.add_argument("--prompts", required=True, help="text file: one prompt per line (or see --chunk-tokens)")
    prof.add_argument("--out", required=True, help="where to write the profile JSON")
    prof.add_argument("--max-tokens", type=integer(0), default=0, help="greedy tokens to decode after each prompt (default 0: prompts only)")
    prof.add_argument("--chunk-tokens", type=integer(1), default=None, help="cut the whole file into prompts of this many tokens instead of lines")
    prof.add_argument("--max-prompts", type=integer(1), default=None, help="use at most this many prompts")
    prof.add_argument("--trace", default=None, help="also write the routing trace (expert ids per token and layer) for `bench --routing-trace`")
    prof.set_defaults(func=run)


def read_profile_prompts(args, engine) -> list[str | list[int]]:
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


def run(args) -> int:
    """Record which experts the prompts use (and optionally the full routing trace)."""
    if args.max_tokens < 0:
        raise InputError("--max-tokens must be 0 or more.")
    if not Path(args.prompts).is_file():
        raise InputError(f"--prompts {args.prompts} does not exist; give a text file with one prompt per line.")
    for flag, out in (("--out", args.out), ("--trace", args.trace)):
        check_output(out, flag)
    checked_model(args)
    from moestream.warmstart.trace import record_profile_and_trace

    engine, load_s = load_engine(args)
    prompts = read_profile_prompts(args, engine)
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

