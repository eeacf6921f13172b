"""A follower rank's process of an expert-parallel group: `python -m moestream.engine.follower RANK
PORT WORLD TIMEOUT_S`, started by rank 0 (`runtime/distributed.py: RankGroup`), or, under torchrun,
the CLI's ranks other than 0 through `run_follower`.

It lives in the engine layer because a follower builds an engine; `runtime/distributed.py` runs the
follower's loop with the `build` it is handed, so imports keep running downward.
"""

from __future__ import annotations

import faulthandler
import gc
import signal
import sys

from moestream.engine.build import build
from moestream.runtime.distributed import follow

def run_follower(rank: int, port: int, world: int, timeout_s: float, host: str = "127.0.0.1") -> None:
    """Join the group at host:port as `rank`, build this rank's engine, make rank 0's calls until it stops."""
    follow(rank, port, world, timeout_s, build, host=host)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: where a stuck follower stands
    run_follower(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    # Stopped: the process ends, and rank 0's close waits for it. The interpreter's teardown would
    # walk every object torch made (~170k) in several collections, 0.7 s; frozen, they go with the
    # process (atexit handlers, stream flushes and thread joins still run as at any exit).
    gc.freeze()
