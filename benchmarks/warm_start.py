"""Start-up time: a cold start (discovery, bank fill, warm-up, snapshot save) against a prepacked warm start.

    python benchmarks/warm_start.py --ckpt /tmp/q3 --out $OUT [--gpu-memory 9781MiB] [--host-tier disk]

Runs `moestream bench CKPT --prepack DIR` twice, each in a fresh process (the first builds and saves
the snapshot, the second loads it), and reports both load times. Results: `$OUT/warm_start.json`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import checkpoint_args, log  # noqa: E402


def main() -> None:
    ap = checkpoint_args(__doc__, run=False)
    ap.add_argument("--gpu-memory", default="9781MiB")
    ap.add_argument("--host-tier", default="disk", help="disk: the pinned tier's fill does not mask the bank's own start")
    ap.add_argument("--prepack", type=Path, default=Path("/tmp/moestream-prepack"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.prepack, ignore_errors=True)
    runs = {}
    for run in ("cold", "warm"):
        path = args.out / f"start_{run}.json"
        cmd = [sys.executable, "-m", "moestream", "bench", str(args.ckpt), "--gpu-memory", args.gpu_memory,
               "--host-tier", args.host_tier, "--prepack", str(args.prepack), "--prompt-tokens", "64",
               "--gen-tokens", "16", "--max-context", "4096", "--json", str(path), "--verbose"]
        log("$", " ".join(cmd))
        subprocess.run(cmd, check=True, timeout=300)
        runs[run] = json.loads(path.read_text())
        log(f"{run}: load {runs[run]['load_s']:.2f} s")
    result = {"cold_load_s": runs["cold"]["load_s"], "warm_load_s": runs["warm"]["load_s"],
              "speedup": runs["cold"]["load_s"] / runs["warm"]["load_s"]}
    log(json.dumps(result))
    (args.out / "warm_start.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
