"""Host-to-device bandwidth from pinned memory by copy size: what one staging copy of 1-150 MB reaches
on this machine's link (a prompt at a bounded bank copies its missing experts in runs of this size).

Each size is copied back to back on one side stream from a 400 MB pinned buffer (offsets walking
through it, so the host pages are not the same each time), timed by CUDA events over ~3 GB.

    python benchmarks/pinned_copy_bandwidth.py [--sizes-mb 1 3.1 6.3 9.4 19 38 75 150]
"""

from __future__ import annotations

import argparse
import sys

import torch

POOL = 400 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 3.1, 6.3, 9.4, 19, 38, 75, 150])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pinned_copy_bandwidth.py needs a CUDA device")
    src = torch.empty(POOL, dtype=torch.uint8).pin_memory()
    dst = torch.empty(POOL, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for mb in args.sizes_mb:
        n = int(mb * (1 << 20))
        reps = max(4, int(3000 / mb))
        with torch.cuda.stream(stream):
            for _ in range(3):
                dst[:n].copy_(src[:n], non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(reps):
                off = (i * n) % (POOL - n)
                dst[off:off + n].copy_(src[off:off + n], non_blocking=True)
            end.record()
        end.synchronize()
        print(f"copy {mb:6.1f} MB: {reps * n / start.elapsed_time(end) / 1e6:6.2f} GB/s")


if __name__ == "__main__":
    main()
