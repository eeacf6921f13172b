"""The parser of every command and `main`: parse, run, and turn every failure into one line."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import sys

from moestream.cli import archs, bench, check, convert, perplexity, profile, run, serve
from moestream.cli.common import follow_rank_0, torchrun
from moestream.cli.flags import Parser
from moestream.cli.interrupts import exit_now, interrupts
from moestream.errors import MoestreamError
from moestream.version import __version__

COMMANDS = (run, perplexity, bench, profile, check, convert, archs, serve)   # the order --help lists them in


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moestream", description="Run Mixture-of-Experts models larger than the accelerator.")
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def quiet_libraries() -> None:
    """Library warnings (torch, transformers) would reach stderr before our own one-line messages;
    --verbose keeps them."""
    import warnings

    warnings.simplefilter("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    """Parse, run, and turn every failure into one line: MoestreamError exits 1, Ctrl-C exits 130
    at any point (imports of torch and transformers included: they happen in here)."""
    interrupts.note = None
    try:
        if argv is None:   # the process's own command line: own its Ctrl-C, and its exit
            interrupts.install()
            # Frozen at exit (after the command's own atexit handlers; the others, stream flushes and
            # thread joins run as at any exit), the process's objects go with it: the interpreter's
            # teardown would collect every object torch made (~170k) several times over, 0.7 s.
            atexit.register(gc.freeze)
        args = build_parser().parse_args(argv)
        args.own_process = argv is None   # process-wide settings (torch's threads) only for the process's own command
        if not getattr(args, "verbose", False):
            quiet_libraries()
        launched = torchrun()
        if launched is not None and launched.rank != 0 and args.command in ("run", "serve", "bench", "profile", "perplexity"):
            return follow_rank_0(launched)
        return args.func(args)
    except MoestreamError as exc:
        print(f"moestream: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupts.message(), file=sys.stderr)
        if argv is None:   # the process's own Ctrl-C: leave now, with 130 (a library that already saw
            exit_now(130)  # the interrupt can otherwise make the interpreter re-raise it at shutdown)
        return 130
    except PermissionError as exc:   # a file of the checkpoint (or an input) the user may not read
        where = exc.filename or "a file it needs"
        print(f"moestream: error: cannot read {where} (permission denied); make it readable or run as a user who "
              "may read it.", file=sys.stderr)
        return 1
    except BrokenPipeError:   # the reader went away (e.g. `| head`): not an error of ours
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return 0
    except Exception:
        # A Ctrl-C that landed inside a library's import can leave that library half-initialised, so
        # the failure surfaces as some other exception (numpy's lazy submodules recurse forever): once
        # an interrupt was seen, whatever follows is that interrupt.
        if not interrupts.seen:
            raise
        print(interrupts.message(), file=sys.stderr)
        if argv is None:
            exit_now(130)
        return 130

