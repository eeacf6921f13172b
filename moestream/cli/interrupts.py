"""Ctrl-C, owned by the command line: remembered so a library cannot swallow it, and ending the
process with one line and exit 130."""

from __future__ import annotations

import contextlib
import os
import sys

class Interrupts:
    """Ctrl-C raises KeyboardInterrupt as usual, and is also remembered: a library that swallows the
    exception (some do, during their imports) cannot lose it, the next check raises it again. One
    landing inside an import is raised once the import is over (`_importing`). One
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
            if _importing(frame):
                _interrupt_again_soon()
                return
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

# How often a Ctrl-C that landed inside an import is raised again until the import is over.
RETRY_S = 0.05


def _importing(frame) -> bool:
    """Whether the main thread is inside an import. A module's import can run Python called from a C++
    extension's initialisation (torch.distributed's does), where an exception raised by the interrupt
    cannot unwind: pybind11 aborts the process (exit -6) instead of exiting 130."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _interrupt_again_soon() -> None:
    """Deliver the Ctrl-C to the main thread again in RETRY_S: once the import is over, it raises. A real
    signal, not `_thread.interrupt_main`, which would not wake a sleep or a wait the thread is in."""
    import signal
    import threading

    main = threading.main_thread().ident
    timer = threading.Timer(RETRY_S, signal.pthread_kill, (main, signal.SIGINT))
    timer.daemon = True
    timer.start()


def exit_now(code: int) -> None:
    """Flush what was written and end the process (nothing of ours is left half-written by then:
    files are written through temporaries that failures remove)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)

