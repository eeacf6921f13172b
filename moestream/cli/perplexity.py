"""`moestream perplexity`: sliding-window (or decode-step) perplexity of a text file, optionally
with the KL divergence to a reference."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from moestream.cli.common import check_output, checked_model, emit_json, load_engine
from moestream.cli.flags import add_json_arg, add_load_args, add_profile_args, integer
from moestream.errors import InputError


def add_parser(sub) -> None:
    ppl = sub.add_parser("perplexity", help="sliding-window perplexity of a text file")
    add_load_args(ppl)
    ppl.add_argument("--file", required=True, help="text or code file to score")
    ppl.add_argument("--window", type=integer(2), default=None, help="window length (default: the context)")
    add_json_arg(ppl, "the result")
    ppl.add_argument("--decode", action="store_true",
                     help="score every token through a decode step (what decode-only approximations such as --miss-policy skip change)")
    ppl.add_argument("--max-tokens", type=integer(1), default=None, help="with --decode: score at most this many tokens")
    ppl.add_argument("--kl-reference", nargs="?", const="same", default=None, metavar="MODEL",
                     help="also report the mean KL divergence to a reference's next-token distributions "
                          "(default: this checkpoint at full precision)")
    add_profile_args(ppl)
    ppl.set_defaults(func=run)


def run(args) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise InputError(f"--file {path} does not exist; give a text or code file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--file {path} is not UTF-8 text; give a text or code file.") from None
    except OSError as exc:
        raise InputError(f"--file {path} cannot be read ({exc.strerror or exc}); give a readable text file.") from None
    if args.decode and args.kl_reference is not None:
        raise InputError("--kl-reference scores prompt windows; run it without --decode.")
    check_output(args.json, "--json")
    checked_model(args)
    from moestream.runtime.perplexity import decode_perplexity, sliding_window_scores

    engine, _ = load_engine(args)
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
    total = len(ids) - 1 if not args.decode else min(len(ids) - 1, args.max_tokens or len(ids))
    with progress_bar(total) as bar:
        if args.decode:
            ppl, n = decode_perplexity(engine, ids, window, args.max_tokens, progress=bar.update)
        else:
            reference = kl_reference(args, engine) if args.kl_reference is not None else None
            scores = sliding_window_scores(engine.logits, ids, window, engine.device,
                                           reference.logits if reference is not None else None, progress=bar.update)
            ppl, n, kl = scores.perplexity, scores.tokens, scores.kl
    result = {"perplexity": ppl, "tokens": n, "window": window, "seconds": time.perf_counter() - t0,
              "mode": "decode" if args.decode else "prefill", "miss_policy": engine.bank.miss_policy,
              "capacity": engine.bank.capacity, "experts": engine.bank.formats[next(iter(engine.bank.formats))].name
              if engine.bank.formats else None, "kl_to_reference": kl}
    extra = f", KL to the reference {kl:.5f} nats/token" if kl is not None else ""
    if args.json:
        emit_json(args.json, result)
    if args.json != "-":
        print(f"perplexity {ppl:.4f} over {n} tokens (window {window}, {result['mode']}, {engine.bank.miss_policy}, "
          f"capacity {engine.bank.capacity}/{engine.config.num_experts}{extra})")
    return 0


def progress_bar(total: int):
    """Tokens scored so far, on stderr where it is a terminal (a long file takes minutes)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="token", desc="perplexity", disable=not sys.stderr.isatty(), dynamic_ncols=True,
                leave=False)


def kl_reference(args, engine):
    """The reference of --kl-reference: another checkpoint, or this one at full precision (no recipe)."""
    import moestream
    from moestream.engine import EngineConfig, RuntimeConfig

    model = str(engine.folder) if args.kl_reference == "same" else args.kl_reference
    return moestream.load(EngineConfig(model, RuntimeConfig(device=str(engine.device), dtype=engine.dtype,
                                                            max_context=args.max_context)))

