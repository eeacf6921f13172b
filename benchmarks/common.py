"""What the GPU benchmarks share: the random full-size checkpoint, the pinned host→device bandwidth
(the transfer roofline) and running the HF transformers peer as a subprocess."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from moestream.fileio import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


def checkpoint_args(doc: str, run: bool = True) -> argparse.ArgumentParser:
    """The arguments every GPU benchmark takes: the checkpoint (written when missing), where results
    go, and (run=True) the prompt and generation lengths of a timed run."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=24)
    if run:
        run_args(ap)
    return ap



def engine_args(doc: str, streams: int, routing: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark that loads an engine in its own process and steps it: the checkpoint
    as it is (a folder or a GGUF file), where results go, device, dtype, bank, streams and routing."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="a checkpoint folder or a GGUF file")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--capacity", type=int, default=None, help="bank slots per layer (none: every expert resident)")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--streams", type=int, default=streams)
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default=routing)
    ap.add_argument("--trace", type=Path, default=Path("benchmarks/traces/demo_heldout_trace.json"))
    return ap

def run_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The prompt and generation lengths of a timed run, and its sampling temperature."""
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampled decode keeps random-weight routing diverse")
    return ap


def log(*a) -> None:
    print(*a, flush=True)


def model_config(ckpt: Path) -> dict:
    """The config.json fields of a checkpoint folder, or of a GGUF file (its metadata as moestream reads it)."""
    from moestream.checkpoint.gguf_file import is_gguf, open_gguf
    if is_gguf(ckpt):
        return open_gguf(ckpt).hf_config()
    return json.loads((ckpt / "config.json").read_text())


def ensure_checkpoint(ckpt: Path, shape: str = "qwen3-30b-a3b", layers: int | None = 24, device: str = "cuda",
                      tiny: bool = False) -> None:
    """Write the random checkpoint of `shape` with `layers` layers (None: the real model's) unless it is
    there already (a GGUF file, or a folder with weights; `tiny`: the shape shrunk, for a smoke test of a
    benchmark on any machine)."""
    if ckpt.is_file() or (ckpt / "model.safetensors.index.json").exists() or (ckpt / "model.safetensors").exists():
        return
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "scripts/make_random_checkpoint.py"), "--shape", shape,
                    *(["--layers", str(layers)] if layers else []), "--dtype", "bf16", "--out", str(ckpt),
                    "--device", device, *(["--tiny"] if tiny else [])], check=True)
    log(f"checkpoint written in {time.perf_counter() - t0:.1f} s")


def pinned_bandwidth(expert_bytes: int = 3 * 768 * 2048 * 2) -> dict:
    """Pinned host→device copy bandwidth: 1 GiB copies, and one expert of `expert_bytes` at a time."""
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 5 * n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(100):
        off = (i * expert_bytes) % (n - expert_bytes)
        dev[off:off + expert_bytes].copy_(host[off:off + expert_bytes], non_blocking=True)
    torch.cuda.synchronize()
    per_expert = 100 * expert_bytes / (time.perf_counter() - t0)
    del host, dev
    return {"pinned_h2d_GBps": h2d / 1e9, "pinned_h2d_per_expert_GBps": per_expert / 1e9}


def hf_peer(ckpt: Path, mode: str, out: Path, extra: list[str], timeout: int) -> dict | None:
    """benchmarks/hf_baseline.py in its own process (its memory is gone when it returns); None if it fails."""
    path = out / f"hf_{mode}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/hf_baseline.py"), str(ckpt), "--mode", mode, "--json", str(path), *extra]
    log("$", " ".join(cmd))
    try:
        subprocess.run(cmd, check=True, timeout=timeout)
        return json.loads(path.read_text())
    except Exception as exc:  # the peer failing must not lose our own numbers
        log(f"HF {mode} failed: {exc}")
        return None


def write_result(out: Path, name: str, result: dict) -> None:
    result["machine"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    result["date"] = time.strftime("%Y-%m-%d")
    result["torch"] = torch.__version__
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"{name}.json", result, indent=2)   # a script killed mid-write leaves the last whole file


def step_kernels(engine, prompt: list[int], steps: int, warm_steps: int, params) -> list[dict]:
    """The CUDA kernels (chrome-trace events, in time order) of `steps` engine steps of one request
    (`prompt`, SamplingParams `params`), after `warm_steps` untimed ones (the prefill among them);
    the request is then run to its end. Decode steps replay their CUDA graphs, kernel by kernel."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    engine.add_request(prompt, params)
    if not torch.cuda.is_available():   # no kernels to see: the steps run, unprofiled
        while not engine.scheduler.idle:
            engine.step()
        return []
    for _ in range(warm_steps):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.loads(Path(f.name).read_text())["traceEvents"] if e.get("cat") == "kernel"]
    while not engine.scheduler.idle:
        engine.step()
    return sorted(events, key=lambda e: e["ts"])
