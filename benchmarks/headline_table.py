"""The headline table: moestream beside llama.cpp on one machine, on random weights of one shape.

Writes the random checkpoint (the 24-layer Qwen3-30B-A3B shape unless told otherwise), its int4 forms
(`moestream convert --experts int4`, and int4 everywhere: `--attention int4 --embeddings int4` too), an
FP8 checkpoint with 128x128 block scales (as DeepSeek and Qwen's -FP8 models ship) and same-shape GGUFs
(BF16, Q8_0 and Q4_0, `benchmarks/random_gguf.py`); then runs both engines, one after the other, on
this machine:

* per format (bf16, int4 experts, int4 everywhere, FP8 block, and llama.cpp's own Q8_0 and Q4_0 files
  read by moestream; beside llama.cpp on BF16, Q4_0, Q4_0, Q8_0, Q8_0, Q4_0): resident decode at batch 1
  and a 512-token prompt; a bank of 25% of the experts (llama.cpp: `--n-cpu-moe` keeps the experts of
  75% of the layers on the CPU) decoding under uniform routing (and, for bf16 and int4, under trace
  replay), and its 512-token prompt (`moestream bench --json`, `llama-bench -o json`);
* served, bf16 resident: 1/16/64 concurrent streams and an agent's second turn with its prefix
  cached, the same requests to our server and to llama-server (`benchmarks/serve_throughput.py`);
  and served at the 25% bank (llama-server `--n-cpu-moe`): 4 and 16 concurrent streams.

It prints one table (markdown) and writes it with its raw results as JSON: each row with our figure,
llama.cpp's, the ratio, our routing, the machine, the date and the commands that made it. A row
whose run failed or whose peer was not run says so; nothing else stops the table.

    python benchmarks/headline_table.py --out /tmp/headline --llama-cpp ~/llama.cpp/build/bin
    python benchmarks/headline_table.py --out /tmp/headline --llama-cpp-src ~/llama.cpp   # builds it first
    python benchmarks/headline_table.py --out /tmp/smoke --tiny --cpu                      # a smoke run, no GPU
    python benchmarks/headline_table.py --out /tmp/fp8 --llama-cpp BIN --formats fp8-block gguf-q8_0 --no-served

`--resume` takes every run that already has a result in the work folder from there, so a table cut
short (a timeout, a lost machine) is finished by running the same command again.

The GGUFs need the `gguf` package (`pip install gguf`; with `--llama-cpp-src` the tree's own gguf-py is
used). Random weights do not route like a trained model, and a random model's own routers pick nearly
the same experts for every token, which flatters any engine whose work depends on the experts a batch
uses: llama.cpp's prompt at `--n-cpu-moe` copies only the experts a ubatch routes to, and its CPU
reads only those. So every file here is written with `--token-routing` (its routers pick experts by the
token alone): llama.cpp, fed random tokens by llama-bench, routes near-uniformly. Our rows state their
routing (uniform synthetic draws, statistically the same, or a replayed trace of the demo model's
routing). Figures move between machines of one kind; only ratios from one run compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.llama_cpp import llama_records  # noqa: E402
from moestream.fileio import write_bytes_atomic, write_json_atomic  # noqa: E402



@dataclass(frozen=True)
class Format:
    """One of our formats beside llama.cpp's GGUF type of the same precision. `source` says how our
    checkpoint is made: "random" (scripts/make_random_checkpoint.py, with `flags`), "convert" (`moestream
    convert` of the bf16 checkpoint, with `flags`) or "gguf" (llama.cpp's own file of type `peer`, read by us)."""
    name: str
    peer: str
    source: str
    flags: tuple[str, ...] = ()
    trace: bool = True        # a trace-replay row beside the uniform one

    @property
    def key(self) -> str:
        return f"gguf-{self.peer}" if self.source == "gguf" else self.name.replace(" ", "-")

    @property
    def label(self) -> str:
        return f"{self.name} / {PEER_NAMES[self.peer]}"


FORMATS = [Format("bf16", "bf16", "random", ("--dtype", "bf16")),
           Format("int4 experts", "q4_0", "convert", ("--experts", "int4")),
           Format("int4 everywhere", "q4_0", "convert", ("--experts", "int4", "--attention", "int4", "--embeddings", "int4")),
           Format("fp8 block", "q8_0", "random", ("--dtype", "bf16", "--fp8-block", "128x128"), trace=False),
           Format("llama.cpp's Q8_0 GGUF", "q8_0", "gguf", trace=False),
           Format("llama.cpp's Q4_0 GGUF", "q4_0", "gguf", trace=False)]
PEER_NAMES = {"bf16": "BF16", "q4_0": "Q4_0", "q8_0": "Q8_0"}
UNIFORM = "uniform (synthetic)"
BANK_SHARE = 0.25


def log(*a) -> None:
    print("[headline]", *a, file=sys.stderr, flush=True)


# ---- running a command: a process of its own with a timeout, or (smoke runs) this process ------------

@dataclass
class Run:
    """One command and what came of it: `result` (parsed output) or `error` (one line)."""
    key: str
    command: list[str]
    result: dict | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def text(self) -> str:
        """The command as a user types it (`python` for this interpreter, paths as given)."""
        return shlex.join(["python" if self.command[0] == sys.executable else self.command[0], *self.command[1:]])


class Runner:
    """Runs commands with a timeout each, in a process group of their own (a timed-out run's server
    children go with it), their output kept in `logs/KEY.log`. `in_process` runs our Python commands
    in this process instead (a tiny CPU smoke run then pays torch's import once; on a GPU every run
    takes a process of its own, so its device memory is gone when it ends)."""

    def __init__(self, logs: Path, in_process: bool):
        self.logs = logs
        self.in_process = in_process
        logs.mkdir(parents=True, exist_ok=True)

    def call(self, key: str, command: list[str], timeout: float, env: dict | None = None) -> str | None:
        """Run `command`; None when it succeeded, else one line saying why not."""
        t0 = time.perf_counter()
        log(f"{key}: $ {shlex.join(command)}")
        try:
            if self.in_process and command[0] == sys.executable and env is None:
                return self._in_process(key, command[1:])
            return self._subprocess(key, command, timeout, env)
        finally:
            log(f"{key}: {time.perf_counter() - t0:.1f} s")

    def _subprocess(self, key: str, command: list[str], timeout: float, env: dict | None) -> str | None:
        """stdout to logs/KEY.log (llama-bench's JSON: kept apart from the model-loading messages it writes to
        stderr between two tests), stderr to logs/KEY.err."""
        path, err_path = self.logs / f"{key}.log", self.logs / f"{key}.err"
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                    **(env or {})}
        with path.open("w") as out, err_path.open("w") as err:
            try:
                proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT, env=full_env, start_new_session=True)
            except OSError as exc:
                return f"could not start {command[0]}: {exc.strerror or exc}"
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)   # the group we started: the command and its children
                proc.wait()
                return f"timed out after {timeout:.0f} s (log: {err_path})"
        if rc != 0:
            return f"exit {rc}: {_last_line(err_path) or _last_line(path) or 'no output'} (log: {err_path})"
        return None

    def _in_process(self, key: str, argv: list[str]) -> str | None:
        saved = sys.argv[:]
        with (self.logs / f"{key}.log").open("w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return self._run_here(argv, saved)

    @staticmethod
    def _run_here(argv: list[str], saved: list[str]) -> str | None:
        try:
            if argv[:2] == ["-m", "moestream"]:
                from moestream.cli.main import main as cli
                sys.argv = ["moestream", *argv[2:]]
                rc = cli(argv[2:])
            else:
                sys.argv = argv[:]
                runpy.run_path(argv[0], run_name="__main__")
                rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception as exc:   # a failing row is reported, not fatal
            traceback.print_exc()
            return f"{type(exc).__name__}: {exc}"
        finally:
            sys.argv = saved
        return None if not rc else f"exit {rc}"


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# ---- the machine ----------------------------------------------------------------------------------

def _quiet(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """GPU, CPU and versions, read without starting CUDA in this process."""
    from importlib.metadata import PackageNotFoundError, version

    gpus = [g.strip() for g in _quiet(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                       "--format=csv,noheader"]).splitlines() if g.strip()]
    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "?"
    mem = ""
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f"{kb / 2**20:.0f} GiB RAM"
    except (OSError, AttributeError):
        pass
    return {"gpu": "; ".join(gpus) if gpus else "no GPU", "gpus": len(gpus), "cpu": cpu, "cores": os.cpu_count(),
            "memory": mem, "torch": torch_version,
            "moestream_commit": _quiet(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "?"}


# ---- preparing the weights and llama.cpp ---------------------------------------------------------

def prepare(args, runner: Runner) -> dict:
    """The checkpoints of our formats and the routing trace: format name → folder, or → why not."""
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    made: dict = {"ckpt": {}, "errors": {}}
    bf16 = w / "ckpt-bf16"
    for fmt in [f for f in args.formats if f.source == "random"]:
        out = w / f"ckpt-{fmt.key}"
        if not ((out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists()):
            flags = list(fmt.flags)
            if args.tiny and "--fp8-block" in flags:   # the tiny shape's widths are not multiples of 128
                flags[flags.index("--fp8-block") + 1] = "16x16"
            cmd = [sys.executable, str(ROOT / "scripts/make_random_checkpoint.py"), "--shape", args.shape,
                   "--layers", str(args.layers), *flags, "--token-routing", "--out", str(out), "--device", args.device,
                   "--overwrite", *(["--tiny"] if args.tiny else [])]
            err = runner.call(f"checkpoint-{fmt.key}", cmd, args.timeout_prepare)
            if err:
                made["errors"][fmt.name] = f"checkpoint not written: {err}"
                continue
        made["ckpt"][fmt.name] = out
    for fmt in [f for f in args.formats if f.source == "convert"]:
        out = w / f"ckpt-{fmt.key}"
        if "bf16" not in made["ckpt"]:
            made["errors"][fmt.name] = "no bf16 checkpoint to convert"
            continue
        if not out.exists():
            err = runner.call(f"convert-{fmt.key}",
                              [sys.executable, "-m", "moestream", "convert", str(bf16), str(out), *fmt.flags,
                               "--device", args.device], args.timeout_prepare)
            if err:
                made["errors"][fmt.name] = f"convert failed: {err}"
                continue
        made["ckpt"][fmt.name] = out
    # the shape every other file follows (GGUFs, the trace): the first random checkpoint written
    made["shape"] = next((made["ckpt"][f.name] for f in args.formats if f.source == "random" and f.name in made["ckpt"]), None)
    if made["shape"] is None and not any(f.source == "random" for f in args.formats):
        made["shape"] = _shape_only(args, w)   # GGUF formats alone: the GGUFs need only the shape's config
    made["trace"] = args.trace if args.trace else (_trace(made["shape"], w) if made["shape"] else None)
    return made


def _shape_only(args, work: Path) -> Path:
    """A folder holding only the config.json of the shape (`make_random_checkpoint.build_config`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_random_checkpoint", ROOT / "scripts/make_random_checkpoint.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # (its dataclasses look it up)
    spec.loader.exec_module(module)
    out = work / "shape"
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", module.build_config(args.shape, args.layers, tiny=args.tiny))
    return out


def _trace(ckpt: Path, work: Path) -> Path:
    """The demo model's routing trace where the checkpoint has its 128 experts, top-8; for any other
    expert count (the tiny smoke shape) a seeded random trace of that count, named as such."""
    config = json.loads((ckpt / "config.json").read_text())
    E, k = config["num_experts"], config["num_experts_per_tok"]
    demo = ROOT / "benchmarks/traces/demo_heldout_trace.json"
    if (E, k) == (128, 8):
        return demo
    import numpy as np

    from moestream.warmstart.trace import RoutingTrace

    rng = np.random.default_rng(0)
    layers = config["num_hidden_layers"]
    ids = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(layers)]) for _ in range(512)])
    path = work / f"random_trace_{E}x{k}.json"
    RoutingTrace(num_experts=E, top_k=k, layers=list(range(layers)), ids=ids, arch=config["model_type"],
                 checkpoint="random (no trained model of this expert count)").save(path)
    return path


def llama_bin(args, runner: Runner) -> tuple[Path | None, str]:
    """llama.cpp's bin folder (built from --llama-cpp-src if given), or None and why not."""
    if args.llama_cpp:
        return Path(args.llama_cpp), ""
    if not args.llama_cpp_src:
        return None, "not run: no llama.cpp given (--llama-cpp BIN_DIR or --llama-cpp-src TREE)"
    build = args.work / "llama-build"
    cuda = [] if args.cpu else ["-DGGML_CUDA=ON", "-DGGML_CUDA_FA_ALL_QUANTS=OFF"]
    arch = _quiet(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]).splitlines()
    if arch and not args.cpu:
        cuda.append(f"-DCMAKE_CUDA_ARCHITECTURES={arch[0].replace('.', '')}")
    ninja = ["-G", "Ninja"] if shutil.which("ninja") and not (build / "CMakeCache.txt").exists() else []
    configure = ["cmake", "-S", str(args.llama_cpp_src), "-B", str(build), *ninja, "-DCMAKE_BUILD_TYPE=Release", *cuda,
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    err = runner.call("llama-cmake", configure, args.timeout_build)
    if not err:
        err = runner.call("llama-build", ["cmake", "--build", str(build), "--target", "llama-bench", "llama-server",
                                          f"-j{os.cpu_count() or 1}"], args.timeout_build)
    if err:
        return None, f"llama.cpp build failed: {err}"
    return build / "bin", ""


def write_ggufs(args, runner: Runner, ckpt: Path, qtypes: set[str]) -> dict:
    """qtype → GGUF path, or → the reason it is missing (a str starting with 'failed')."""
    out: dict = {}
    env = None
    gguf_py = args.gguf_py or (Path(args.llama_cpp_src) / "gguf-py" if args.llama_cpp_src else None)
    if gguf_py:
        env = {"PYTHONPATH": os.pathsep.join([str(gguf_py), str(ROOT)])}
    for qtype in sorted(qtypes):
        path = _gguf_path(args, {}, qtype)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            err = runner.call(f"gguf-{qtype}", [sys.executable, str(ROOT / "benchmarks/random_gguf.py"), str(path),
                                                "--config", str(ckpt / "config.json"), "--qtype", qtype,
                                                "--token-routing"],
                              args.timeout_prepare, env=env or {})
            if err:
                out[qtype] = f"failed: GGUF not written: {err}"
                continue
        out[qtype] = path
    return out


# ---- the runs ------------------------------------------------------------------------------------

class Results:
    """Each finished run's record in `work/runs/KEY.json`; with `resume`, a run whose record holds a
    result for the same command is taken from it instead of run again (a table finished across
    several sittings on one machine)."""

    def __init__(self, folder: Path, resume: bool):
        self.folder = folder
        self.resume = resume
        folder.mkdir(parents=True, exist_ok=True)

    def reuse(self, run: Run) -> bool:
        path = self.folder / f"{run.key}.json"
        if not self.resume or not path.exists():
            return False
        try:
            saved = json.loads(path.read_text())
        except ValueError:
            return False
        if saved.get("command") != run.command or saved.get("error") or saved.get("result") is None:
            return False
        run.result, run.seconds = saved["result"], saved.get("seconds", 0.0)
        log(f"{run.key}: taken from {path}")
        return True

    def save(self, run: Run) -> None:
        write_json_atomic(self.folder / f"{run.key}.json", {"command": run.command, "error": run.error,
                                                           "seconds": run.seconds, "result": run.result})


def bench_runs(args, runner: Runner, made: dict, results: Results) -> dict[str, Run]:
    """Our `moestream bench --json` runs: per format, resident, 25% uniform (and 25% trace)."""
    runs: dict[str, Run] = {}
    for fmt in args.formats:
        ckpt = made["ckpt"].get(fmt.name)
        for kind in ("resident", "bank-uniform", "bank-trace") if fmt.trace else ("resident", "bank-uniform"):
            key = f"ours-{fmt.key}-{kind}"
            out = args.work / "results" / f"{key}.json"
            cmd = [sys.executable, "-m", "moestream", "bench", str(ckpt), "--device", args.device, "--json", str(out)]
            if kind == "bank-trace":
                cmd += ["--routing-trace", str(made["trace"]), "--temperature", "0",
                        "--prompt-tokens", str(args.trace_prompt_tokens), "--gen-tokens", str(args.trace_gen_tokens)]
            else:
                cmd += ["--routing", "uniform", "--temperature", "1.0", "--prompt-tokens", str(args.prompt_tokens),
                        "--gen-tokens", str(args.gen_tokens)]
            if kind != "resident":   # auto: the hybrid policy where the format's experts allow it, else fetch
                cmd += ["--capacity", str(made["capacity"]), "--miss-policy", "auto", "--host-tier", "pinned"]
            run = runs[key] = Run(key, cmd)
            if ckpt is None:
                run.error = made["errors"].get(fmt.name, "no checkpoint")
                continue
            if results.reuse(run):
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            out.unlink(missing_ok=True)
            t0 = time.perf_counter()
            run.error = runner.call(key, cmd, args.timeout_run)
            run.seconds = time.perf_counter() - t0
            if run.error is None:
                run.result = _read_json(out, run)
            results.save(run)
    return runs


def peer_runs(args, runner: Runner, bin_dir: Path | None, ggufs: dict, why: str,
              results: Results | None = None) -> dict[str, Run]:
    """`llama-bench -o json` per GGUF type at --n-cpu-moe 0 (resident) and at the 25% bank's layers."""
    runs: dict[str, Run] = {}
    for qtype in sorted({f.peer for f in args.formats} if hasattr(args, "formats") else ggufs):
        for kind, n_cpu_moe in (("resident", 0), ("bank", args.n_cpu_moe)):
            key = f"llama-{qtype}-{kind}"
            gguf = ggufs.get(qtype)
            cmd = [str((bin_dir or Path("LLAMA_CPP_BIN")) / "llama-bench"), "-m", str(_gguf_path(args, ggufs, qtype)),
                   "-ngl", "0" if args.cpu else "99", "-fa", "1", "-p", str(args.prompt_tokens), "-n",
                   str(args.gen_tokens), "-r", str(args.repetitions), "--n-cpu-moe", str(n_cpu_moe), "-o", "json"]
            run = runs[key] = Run(key, cmd)
            if bin_dir is None:
                run.error = why
                continue
            if not isinstance(gguf, Path):
                run.error = gguf or "failed: no GGUF"
                continue
            if results is not None and results.reuse(run):
                continue
            t0 = time.perf_counter()
            err = runner.call(key, cmd, args.timeout_run)
            run.seconds = time.perf_counter() - t0
            if err:
                run.error = f"failed: {err}"
            else:
                try:
                    records = llama_records((runner.logs / f"{key}.log").read_text())
                    run.result = {"prompt_tok_s": next(r["avg_ts"] for r in records if r["n_prompt"] > 0 and r["n_gen"] == 0),
                                  "decode_tok_s": next(r["avg_ts"] for r in records if r["n_gen"] > 0 and r["n_prompt"] == 0),
                                  "records": records}
                except (ValueError, StopIteration, KeyError, TypeError) as exc:
                    run.error = f"failed: llama-bench's JSON not read ({type(exc).__name__})"
            if results is not None:
                results.save(run)
    return runs


def _gguf_path(args, ggufs: dict, qtype: str) -> Path:
    """Where the GGUF of `qtype` is (or would be: a command is shown even for a peer that did not run)."""
    if isinstance(ggufs.get(qtype), Path):
        return ggufs[qtype]
    return Path(getattr(args, "gguf_dir", None) or args.work) / f"peer-{qtype}.gguf"


def served_runs(args, runner: Runner, made: dict, bin_dir: Path | None, ggufs: dict, why: str,
                results: Results, bank: bool = False) -> dict[str, Run]:
    """benchmarks/serve_throughput.py, ours and then llama-server's (each its own run, so one failing
    keeps the other), bf16, uniform routing: resident, with the agent's second turn; or (`bank`) at the
    25% bank beside llama-server's `--n-cpu-moe`, `--bank-streams` streams only."""
    runs: dict[str, Run] = {}
    ckpt = made["ckpt"].get("bf16")
    streams = args.bank_streams if bank else args.streams
    prefix = 0 if bank else args.prefix_tokens
    context = args.serve_prompt_tokens + args.serve_gen_tokens + 64 if bank else args.prefix_tokens + 2 * args.new_tokens + 64
    base = [sys.executable, str(ROOT / "benchmarks/serve_throughput.py"), "--ckpt", str(ckpt), "--no-write",
            "--routing", "uniform", "--streams", *map(str, streams), "--prompt-tokens", str(args.serve_prompt_tokens),
            "--gen-tokens", str(args.serve_gen_tokens), "--prefix-tokens", str(prefix),
            "--new-tokens", str(args.new_tokens), "--max-context", str(context)]
    if bank:
        base += ["--capacity", str(made["capacity"])]
    if args.tiny:
        base += ["--prefix-cache-memory", "64MiB"]
    if runner.in_process:
        base += ["--server-thread"]
    suffix = "-bank" if bank else ""
    for key, extra in ((f"served-ours{suffix}", []),
                       (f"served-llama{suffix}", ["--peer-only", "--llama-server",
                                                  str((bin_dir or Path("LLAMA_CPP_BIN")) / "llama-server"),
                                                  "--gguf", str(_gguf_path(args, ggufs, "bf16")),
                                                  "--peer-n-cpu-moe", str(args.n_cpu_moe if bank else 0)])):
        out = args.work / "results" / key
        cmd = [*base, "--out", str(out), *extra]
        run = runs[key] = Run(key, cmd)
        if args.no_served or FORMATS[0] not in args.formats:
            run.error = "not run: " + ("--no-served" if args.no_served else "bf16 is not among --formats")
            continue
        if ckpt is None:
            run.error = made["errors"].get("bf16", "no checkpoint")
            continue
        if key.startswith("served-llama"):
            if bin_dir is None:
                run.error = why
                continue
            if not isinstance(ggufs.get("bf16"), Path):
                run.error = ggufs.get("bf16") or "failed: no GGUF"
                continue
        if results.reuse(run):
            continue
        (out / "serve_throughput.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        err = runner.call(key, cmd, args.timeout_serve)
        run.seconds = time.perf_counter() - t0
        if err:
            run.error = err if key.startswith("served-ours") else f"failed: {err}"
        else:
            data = _read_json(out / "serve_throughput.json", run)
            if data is not None:
                run.result = data.get("llama_server" if key.startswith("served-llama") else "ours")
                if run.result is None:
                    run.error = "no result in serve_throughput.json"
        results.save(run)
    return runs


def _read_json(path: Path, run: Run) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        run.error = f"no result file ({type(exc).__name__}: {path})"
        return None


# ---- the table -----------------------------------------------------------------------------------

@dataclass
class Row:
    row: str
    format: str          # ours / llama.cpp's
    routing: str         # ours (llama.cpp's: the token-routed file's own, near-uniform)
    unit: str            # tok/s (higher is better) or ms (lower is better)
    ours: float | None
    llama_cpp: float | None
    ratio: float | None  # above 1: moestream faster (tok/s: ours ÷ theirs; ms: theirs ÷ ours)
    ours_note: str = ""
    llama_cpp_note: str = ""
    commands: list[str] = field(default_factory=list)   # keys into the table's runs


def _cell(run: Run | None, pick) -> tuple[float | None, str]:
    if run is None:
        return None, "not run"
    if run.error:
        return None, run.error
    try:
        value = pick(run.result)
    except (KeyError, TypeError, IndexError, StopIteration):
        return None, "no such figure in the result"
    return (float(value), "") if value is not None else (None, "no such figure in the result")


def make_rows(ours: dict[str, Run], peer: dict[str, Run], served: dict[str, Run], trace_label: str,
              n_cpu_moe: int, layers: int, streams: list[int], formats: list[Format] | None = None,
              bank_streams: list[int] | None = None) -> list[Row]:
    """Every headline row from the runs (a run that failed leaves its rows' cells empty, with why)."""
    rows: list[Row] = []

    def add(name, fmt, routing, unit, ours_run, ours_pick, peer_run, peer_pick):
        o, on = _cell(ours_run, ours_pick)
        p, pn = _cell(peer_run, peer_pick)
        ratio = None
        if o and p:
            ratio = o / p if unit == "tok/s" else p / o
        rows.append(Row(name, fmt, routing, unit, o, p, ratio, on, pn,
                        [r.key for r in (ours_run, peer_run) if r is not None]))

    bank = f"25% bank (llama.cpp --n-cpu-moe {n_cpu_moe} of {layers})"
    specs = [("resident decode, batch 1", "resident", "resident", "decode_tok_s", "decode_tok_s", UNIFORM),
             ("resident prompt", "resident", "resident", "prefill_tok_s", "prompt_tok_s", UNIFORM),
             (f"{bank} decode", "bank-uniform", "bank", "decode_tok_s", "decode_tok_s", UNIFORM),
             (f"{bank} decode", "bank-trace", "bank", "decode_tok_s", "decode_tok_s", trace_label),
             (f"{bank} prompt", "bank-uniform", "bank", "prefill_tok_s", "prompt_tok_s", UNIFORM)]
    for name, kind, peer_kind, ours_key, peer_key, routing in specs:
        for fmt in formats or FORMATS:
            if kind == "bank-trace" and not fmt.trace:
                continue
            add(name, fmt.label, routing, "tok/s",
                ours.get(f"ours-{fmt.key}-{kind}"), lambda r, k=ours_key: r[k],
                peer.get(f"llama-{fmt.peer}-{peer_kind}"), lambda r, k=peer_key: r[k])
    so, sp = served.get("served-ours"), served.get("served-llama")
    for n in streams:
        pick = lambda r, n=n: next(s["aggregate_decode_tok_s"] for s in r["streams"] if s["streams"] == n)  # noqa: E731
        add(f"served, {n} stream{'s' if n > 1 else ''} (aggregate decode)", "bf16 / BF16", UNIFORM, "tok/s",
            so, pick, sp, pick)
    for turn, key in (("cached", "ttft_cached_ms"), ("cold", "ttft_cold_ms")):
        pick = lambda r, k=key: r["second_turn"][k]  # noqa: E731
        add(f"agent's second turn, prefix {turn} (time to first token)", "bf16 / BF16", UNIFORM, "ms", so, pick, sp, pick)
    so, sp = served.get("served-ours-bank"), served.get("served-llama-bank")
    for n in bank_streams or []:
        pick = lambda r, n=n: next(s["aggregate_decode_tok_s"] for s in r["streams"] if s["streams"] == n)  # noqa: E731
        add(f"served at a {bank}, {n} streams (aggregate decode)", "bf16 / BF16", UNIFORM, "tok/s", so, pick, sp, pick)
    return rows


def _fmt(value: float | None, unit: str, note: str) -> str:
    if value is None:
        return "not run" if note.startswith("not run") else (note or "–")
    return f"{value:,.1f} ms" if unit == "ms" else f"{value:,.1f}"


def markdown(table: dict) -> str:
    m = table["machine"]
    lines = [f"**moestream beside llama.cpp, {table['shape']}, random weights, {table['date']}**", "",
             f"Machine: {m['gpu']}; {m['cpu']} ({m['cores']} cores{', ' + m['memory'] if m['memory'] else ''}); "
             f"torch {m['torch']}; moestream {m['moestream_commit']}.", "",
             f"Reproduce: `{table['command']}`", "",
             "tok/s unless marked ms; ratio above 1: moestream is faster (tok/s: ours ÷ llama.cpp's, "
             "ms: llama.cpp's ÷ ours). llama.cpp runs the GGUF's own routing, which routes by the token "
             "(`--token-routing`): near-uniform over llama-bench's random tokens.", "",
             *([f"llama.cpp {table['peer_missing']}.", ""] if table.get("peer_missing") else []),
             "| # | row | format (ours / llama.cpp) | our routing | moestream | llama.cpp | ratio | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(table["rows"], 1):
        ratio = f"**{r['ratio']:.2f}×**" if r["ratio"] is not None else ""
        lines.append(f"| {i} | {r['row']} | {r['format']} | {r['routing']} | {_fmt(r['ours'], r['unit'], r['ours_note'])} "
                     f"| {_fmt(r['llama_cpp'], r['unit'], r['llama_cpp_note'])} | {ratio} | {', '.join(r['commands'])} |")
    lines += ["", ("Runs, one after the other, in this process (a smoke run: our server in a thread beside its "
                   "clients, so its figures compare with nothing):" if table["in_process"]
                   else "Runs, one after the other, each in a process of its own:"), ""]
    for key, run in table["runs"].items():
        if run["error"] and run["error"].startswith("not run"):
            continue
        state = f" — **{run['error']}**" if run["error"] else ""
        lines.append(f"- {key}: `{run['command']}`{state}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    class Help(argparse.RawDescriptionHelpFormatter):
        """The module's text after the options; each option that has a default says it."""

        def _get_help_string(self, action):
            text = action.help or ""
            if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
                text += " (default: %(default)s)"
            return text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Help,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", type=Path, required=True, help="where headline_table.md and .json go")
    ap.add_argument("--work", type=Path, default=None, help="checkpoints, GGUFs, logs and raw results (default: OUT/work); "
                    "what is there already is reused")
    peer = ap.add_mutually_exclusive_group()
    peer.add_argument("--llama-cpp", default=None, metavar="BIN_DIR", help="llama.cpp's build folder of llama-bench and llama-server")
    peer.add_argument("--llama-cpp-src", default=None, metavar="TREE", help="build llama.cpp from this source tree (cmake, CUDA)")
    ap.add_argument("--gguf-py", type=Path, default=None, help="llama.cpp's gguf-py folder (default: the tree's, or an installed gguf)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="scripts/make_random_checkpoint.py's shape (GGUFs: qwen3_moe shapes)")
    ap.add_argument("--layers", type=int, default=24, help="layers of the checkpoint (the 25%% bank's llama.cpp rows keep "
                    "the experts of 75%% of them on the CPU)")
    ap.add_argument("--tiny", action="store_true", help="the shape shrunk (2 layers, 16 experts): a smoke run")
    ap.add_argument("--cpu", action="store_true", help="run our engine on the CPU, in this process (smoke runs)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt of the prompt rows (and before decode)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="tokens decoded in the decode rows")
    ap.add_argument("--trace-prompt-tokens", type=int, default=256, help="prompt before the trace-replay decode")
    ap.add_argument("--trace-gen-tokens", type=int, default=128, help="tokens decoded under trace replay")
    ap.add_argument("--trace", type=Path, default=None, help="routing trace to replay (default: the demo model's)")
    ap.add_argument("--repetitions", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 16, 64], help="concurrent streams of the served rows")
    ap.add_argument("--bank-streams", type=int, nargs="*", default=[4, 16],
                    help="concurrent streams of the served rows at the 25%% bank")
    ap.add_argument("--serve-prompt-tokens", type=int, default=128, help="prompt of each served stream")
    ap.add_argument("--serve-gen-tokens", type=int, default=128, help="tokens generated per served stream")
    ap.add_argument("--prefix-tokens", type=int, default=8192, help="the agent turn's cached prefix")
    ap.add_argument("--new-tokens", type=int, default=200, help="the agent turn's new tokens after the prefix")
    ap.add_argument("--timeout-run", type=float, default=1200, help="seconds for each measured run")
    ap.add_argument("--timeout-serve", type=float, default=3600, help="seconds for each served run")
    ap.add_argument("--timeout-prepare", type=float, default=3600, help="seconds to write a checkpoint, convert, write a GGUF")
    ap.add_argument("--timeout-build", type=float, default=3600, help="seconds for each step of the llama.cpp build")
    ap.add_argument("--formats", nargs="+", choices=[f.key for f in FORMATS], default=[f.key for f in FORMATS],
                    help="our formats to run (each beside llama.cpp's GGUF type of the same precision)")
    ap.add_argument("--gguf-dir", type=Path, default=None, help="where the GGUFs go (default: the work folder)")
    ap.add_argument("--resume", action="store_true", help="take each run that already has a result in the work "
                    "folder from there (a table finished across several sittings on one machine)")
    ap.add_argument("--no-served", action="store_true", help="leave out the served rows (our server and llama-server)")
    ap.add_argument("--prepare-only", action="store_true", help="write the checkpoints and GGUFs (and build llama.cpp), "
                    "run nothing")
    args = ap.parse_args(argv)
    args.formats = [f for f in FORMATS if f.key in args.formats]
    if any(f.source == "convert" for f in args.formats) and FORMATS[0] not in args.formats:
        args.formats.insert(0, FORMATS[0])   # the converted formats are made from it
    if args.tiny:   # lengths the tiny shape's 512 positions hold, and a run in seconds
        for name, value in (("layers", 2), ("prompt_tokens", 32), ("gen_tokens", 8), ("trace_prompt_tokens", 16),
                            ("trace_gen_tokens", 8), ("repetitions", 1), ("serve_prompt_tokens", 16),
                            ("serve_gen_tokens", 8), ("prefix_tokens", 64), ("new_tokens", 8)):
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
        if args.streams == ap.get_default("streams"):
            args.streams = [1, 4]
        if args.bank_streams == ap.get_default("bank_streams"):
            args.bank_streams = [2]
    args.device = "cpu" if args.cpu else "cuda"
    args.work = args.work or args.out / "work"
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/headline_table.py", *(sys.argv[1:] if argv is None else argv)])

    runner = Runner(args.work / "logs", in_process=args.cpu)
    info = machine()
    made = prepare(args, runner)
    config = {}
    if made["shape"] is not None:
        config = json.loads((made["shape"] / "config.json").read_text())
    experts, layers = config.get("num_experts", 0), config.get("num_hidden_layers", args.layers)
    # a quarter of the experts, and never fewer than a token's top-k (the fetch policy's least)
    made["capacity"] = max(1, round(BANK_SHARE * experts), config.get("num_experts_per_tok", 1))
    args.n_cpu_moe = layers - round(BANK_SHARE * layers)
    bin_dir, why = llama_bin(args, runner)
    wanted = {f.peer for f in args.formats if f.source == "gguf"} | ({f.peer for f in args.formats} if bin_dir else set())
    ggufs = write_ggufs(args, runner, made["shape"], wanted) if made["shape"] is not None else {}
    for fmt in [f for f in args.formats if f.source == "gguf"]:   # llama.cpp's own file, read by us
        if isinstance(ggufs.get(fmt.peer), Path):
            made["ckpt"][fmt.name] = ggufs[fmt.peer]
        else:
            made["errors"][fmt.name] = ggufs.get(fmt.peer) or "no random checkpoint to shape the GGUF"
    if args.prepare_only:
        log("prepared: " + ", ".join(f"{k}: {v}" for k, v in {**made["ckpt"], **made["errors"]}.items())
            + (f"; llama.cpp: {bin_dir}" if bin_dir else f"; llama.cpp {why}"))
        return 1 if made["errors"] else 0
    results = Results(args.work / "runs", args.resume)
    ours = bench_runs(args, runner, made, results)
    peer_r = peer_runs(args, runner, bin_dir, ggufs, why, results)
    served = {**served_runs(args, runner, made, bin_dir, ggufs, why, results),
              **served_runs(args, runner, made, bin_dir, ggufs, why, results, bank=True)}

    trace = made.get("trace")
    trace_label = ("trace replay (demo model)" if trace and Path(trace).name == "demo_heldout_trace.json"
                   else f"trace replay ({Path(trace).name if trace else '?'})")
    rows = make_rows(ours, peer_r, served, trace_label, args.n_cpu_moe, layers, args.streams, args.formats,
                     args.bank_streams)
    all_runs = {**ours, **peer_r, **served}
    shape = f"{args.shape}{' (tiny)' if args.tiny else ''}, {layers} layers, {experts} experts"
    table = {"date": time.strftime("%Y-%m-%d"), "machine": info, "command": command, "shape": shape,
             "capacity": made["capacity"], "n_cpu_moe": args.n_cpu_moe, "peer_missing": why,
             "in_process": runner.in_process,
             "rows": [asdict(r) for r in rows],
             "runs": {k: {"command": r.text, "error": r.error, "seconds": round(r.seconds, 1), "result": r.result}
                      for k, r in all_runs.items()}}
    text = markdown(table)
    write_json_atomic(args.out / "headline_table.json", table, indent=2)
    write_bytes_atomic(args.out / "headline_table.md", text.encode())
    print(text)
    failed = [k for k, r in all_runs.items() if r.error and not r.error.startswith("not run")]
    log(f"wrote {args.out / 'headline_table.md'} and .json; {len(failed)} run(s) failed" + (f": {', '.join(failed)}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
