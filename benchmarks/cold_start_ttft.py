"""Time to a first token from a cold start, per checkpoint format, beside the first checkpoint named.

What a user waits for after typing `moestream run MODEL`: the interpreter and torch starting, the
checkpoint read and laid out (the bank filled, quantized or packed experts read as stored, a GGUF's
tensors mapped), the kernels' first compiles and the prompt. Each `--ckpt NAME=PATH` (a folder or a
GGUF file: the same model in several formats, e.g. bf16, FP8 block, int4, a GGUF) runs `moestream run
PATH --max-tokens 1 --json` in a fresh process `--repeats` times, in turn (bf16, fp8, ..., then again),
on the same prompt of `--prompt-tokens` random token ids (a checkpoint with a tokenizer reads them as
text: its prompt count is reported). Per run: the process's wall time from its start to its exit, and
the run's own load time and time to first token (`run --json`). The files are read from wherever the
operating system has them: a checkpoint just written, or run before, sits in the page cache (say so
beside a figure); the first repeat of each is the one a user meets after a copy.

    python benchmarks/cold_start_ttft.py --out /tmp/cold --ckpt bf16=/tmp/q3 --ckpt fp8=/tmp/q3-fp8 \\
        --ckpt q4_0=/tmp/q3-q4_0.gguf [--capacity 32] [--repeats 2] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import log, model_config, write_result  # noqa: E402


def named_checkpoint(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--ckpt takes NAME=PATH (e.g. bf16=/tmp/q3), got {text!r}")
    return name, Path(path)


def one_run(path: Path, prompt: str, args) -> dict:
    """`moestream run` in a fresh process: its wall time to exit and the figures it reports."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "moestream", "run", str(path), "-p", prompt, "--max-tokens", "1",
               "--json", str(report), "--device", args.device]
        if args.capacity is not None:
            cmd += ["--capacity", str(args.capacity)]
        if args.gpu_memory is not None:
            cmd += ["--gpu-memory", args.gpu_memory]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1], "wall_s": wall}
        run = json.loads(report.read_text())["run"]
    return {"wall_s": wall, "load_s": run["load_s"], "ttft_s": run["ttft_s"], "prompt_tokens": run["prompt_tokens"],
            "peak_memory_bytes": run["peak_memory_bytes"], "device": run["device"]}


def vocab_of(checkpoints: list[tuple[str, Path]]) -> int:
    """The smallest vocabulary of the checkpoints that exist (a folder's config.json or a GGUF's metadata)."""
    sizes = [model_config(p).get("vocab_size") for _, p in checkpoints if p.exists()]
    return min([s for s in sizes if s] or [32000])


def run(args) -> dict:
    rng = random.Random(0)
    vocab = args.vocab or vocab_of(args.ckpt)
    prompt = " ".join(str(rng.randrange(1, vocab)) for _ in range(args.prompt_tokens))
    runs: dict[str, list[dict]] = {name: [] for name, _ in args.ckpt}
    for _ in range(args.repeats):   # in turn, so no format always follows the same one
        for name, path in args.ckpt:
            runs[name].append(one_run(path, prompt, args))
            done = runs[name][-1]   # logged as it ends, so a run cut short keeps what it measured
            log(f"{name:>10}: " + (f"failed: {done['error']}" if "error" in done else
                                   f"{done['wall_s']:.2f} s to exit (load {done['load_s']:.2f} s, first token "
                                   f"{1000 * done['ttft_s']:.0f} ms)"))
    rows, base = [], None
    for name, path in args.ckpt:
        good = [r for r in runs[name] if "error" not in r]
        row = {"name": name, "path": str(path), "runs": runs[name]}
        if good:
            row.update(first_wall_s=good[0]["wall_s"], median_wall_s=statistics.median(r["wall_s"] for r in good),
                       median_load_s=statistics.median(r["load_s"] for r in good),
                       median_ttft_s=statistics.median(r["ttft_s"] for r in good),
                       prompt_tokens=good[0]["prompt_tokens"])
            base = base if base is not None else row["median_wall_s"]
            row["wall_vs_first"] = row["median_wall_s"] / base
        else:
            row["error"] = runs[name][0]["error"]
        rows.append(row)
    return {"prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "device": args.device,
            "capacity": args.capacity, "gpu_memory": args.gpu_memory, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=named_checkpoint, action="append", required=True, metavar="NAME=PATH",
                    help="a checkpoint (folder or GGUF file) under a name; the first is the others' reference")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=None,
                    help="token ids are drawn below this (default: the smallest vocabulary a folder's config names)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    args = ap.parse_args()
    result = run(args)
    for r in result["rows"]:
        if "error" in r:
            log(f"{r['name']:>10}: failed: {r['error']}")
            continue
        log(f"{r['name']:>10}: first token {r['median_wall_s']:.2f} s from a fresh process (first run "
            f"{r['first_wall_s']:.2f} s; load {r['median_load_s']:.2f} s, prompt of {r['prompt_tokens']} tokens "
            f"{1000 * r['median_ttft_s']:.0f} ms), {r['wall_vs_first']:.2f}x the first's")
    write_result(args.out, "cold_start_ttft", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
