"""Ctrl-C, owned by the command line: remembered so a library cannot swallow it, and ending the
process with one line and exit 130."""

from __future__ import annotations

import contextlib
import os
import sys

class Interrupts:
    """Ctrl-C raises KeyboardInterrupt as usual, and is also remembered: a library that swallows the
    exception (some do, during their imports) cannot lose it, the next check raises it again. One
    raised inside a finalizer (`__del__`) cannot propagate, CPython reports it as "unraisable" with a
    traceback; that report is silenced, since the remembered interrupt ends the run anyway."""

    def __init__(self):
        self.seen = False
        self.note: str | None = None   # what the command adds to "moestream: interrupted" (how to resume)

    def message(self) -> str:
        return "moestream: interrupted" + (f"; {self.note}" if self.note else "")

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


interrupts = Interrupts()


def exit_now(code: int) -> None:
    """Flush what was written and end the process (nothing of ours is left half-written by then:
    files are written through temporaries that failures remove)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)

