"""Decode of the newer families at full-size shapes: moestream resident and at a 25% expert bank beside HF transformers on the same weights; MLA shapes also with the absorbed form.

    python benchmarks/family_decode.py --out $OUT --shape glm-4.7-flash:16 --shape gpt-oss-20b:12
        [--root /tmp/family] [--prompt-tokens 512 --gen-tokens 64 --temperature 1.0] [--fraction 0.25]
        [--long-prompt-tokens 2048] [--no-peer] [--keep] [--budget-s 570]

`--shape NAME:LAYERS` names a shape of scripts/make_random_checkpoint.py and how many of its layers to
write (repeatable; shapes run one after another). Per shape (`measure_shape`): the random bf16
checkpoint is written on the GPU, then
  1. moestream resident (every expert on the GPU): TTFT of a --prompt-tokens prompt, batch-1 decode;
  2. MLA shapes: the same with the absorbed form (`mla_absorbed`); both forms also after a
     --long-prompt-tokens prompt, where the expanded form's per-call up-projection costs most;
  3. moestream with a bank of --fraction of each layer's experts (capacity round(E x fraction), at
     least top-k; the rest in pinned host RAM; exact fetch); its budget is what `plan_memory` says
     that capacity needs;
  4. HF transformers resident (`hf_baseline.py --mode resident`: 512-token prompt, 32 greedy tokens);
  5. HF transformers + accelerate offload with that budget as its GPU max_memory (32-token prompt,
     3 tokens: it moves most weights per forward).
moestream's routing is uniform synthetic (labelled: k distinct experts per token, the worst case for a
bank; at full residency it changes which experts are read, not how many bytes), sampled at
--temperature; HF runs its own routing, greedy. The checkpoint is deleted after its shape unless
--keep (the device's disk holds one at a time). Each shape gets an equal share of what is left of
--budget-s; steps that would not finish within it are skipped and say so. Results:
`$OUT/family_decode.json` (rewritten after every step, so a call cut short keeps what finished) and a
table per shape.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ensure_checkpoint, hf_peer, log, run_args, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.engine import EngineConfig  # noqa: E402
from moestream.engine.plan import plan_load, plan_memory  # noqa: E402
from moestream.bench import apply_routing, run_bench  # noqa: E402
from moestream.sizes import format_bytes  # noqa: E402

MAX_CONTEXT = 4096
HF_RESIDENT_S, HF_OFFLOAD_S = 300, 420   # the peers' own time limits (shortened to what the budget leaves)


class Deadline:
    """The call's time budget: what is left, and whether a step expected to take `need` seconds fits."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, need: float) -> bool:
        return self.left() >= need


def parse_shape(text: str) -> tuple[str, int | None]:
    """`NAME:LAYERS` (or `NAME` for the real model's layer count)."""
    name, _, layers = text.partition(":")
    return name, int(layers) if layers else None


def free_device() -> None:
    """Give back what a dropped engine held, so the next step's peak memory is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def moestream_row(ckpt: Path, args, label: str, prompts: list[int], **load) -> tuple[list[dict], object]:
    """Load, swap in uniform routing, time one run per prompt length; returns the rows and the config."""
    t0 = time.perf_counter()
    engine = moestream.load(ckpt, device=args.device, dtype="bfloat16", max_context=MAX_CONTEXT, **load)
    load_s = time.perf_counter() - t0
    routing = apply_routing(engine, "uniform")
    rows = []
    for n in prompts:
        res = run_bench(engine, n, args.gen_tokens, load_s, temperature=args.temperature, routing=routing).as_dict()
        res["row"] = label
        rows.append(res)
        log(f"[{label}] prompt {n}: TTFT {res['ttft_s'] * 1e3:.1f} ms, decode {res['decode_tok_s']:.2f} tok/s, "
            f"hit rate {res['decode_hit_rate']:.1%}, capacity {res['capacity']}/{res['num_experts']}")
    config = engine.config
    del engine, routing
    free_device()
    return rows, config


def measure_shape(result: dict, args, deadline: Deadline, record) -> None:
    """Every row of one shape into `result` ({"shape", "layers", "rows", "skipped"}); `record()` is called
    after each step so that nothing finished is lost."""
    shape, layers = result["shape"], result["layers"]
    ckpt = args.root / shape
    t0 = time.perf_counter()
    ensure_checkpoint(ckpt, shape, layers, args.device, tiny=args.tiny)
    result["checkpoint_write_s"] = time.perf_counter() - t0
    result["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    log(f"=== {shape}: {layers or 'all'} layers, {format_bytes(result['checkpoint_bytes'])}")
    record()

    mla = plan_load(EngineConfig.from_kwargs(ckpt, device=args.device)).config.latent_attention
    rows, config = moestream_row(ckpt, args, "resident" + (", MLA expanded" if mla else ""), [args.prompt_tokens])
    result["rows"] += rows
    result["layers"] = config.num_layers
    record()
    if mla is not None:
        for absorbed in (False, True):
            if not deadline.allows(60):
                result["skipped"].append(f"MLA {'absorbed' if absorbed else 'expanded'} form: out of time")
                continue
            label = "resident, MLA absorbed" if absorbed else "resident, MLA expanded"
            prompts = [args.long_prompt_tokens] if not absorbed else [args.prompt_tokens, args.long_prompt_tokens]
            rows, _ = moestream_row(ckpt, args, label, prompts, mla_absorbed=absorbed)
            result["rows"] += rows
            record()

    capacity = max(config.top_k, round(config.num_experts * args.fraction))
    budget = plan_memory(config, torch.bfloat16, capacity=capacity, max_context=MAX_CONTEXT).total_bytes
    result["bounded"] = {"fraction": args.fraction, "capacity": capacity, "budget_bytes": budget}
    if deadline.allows(90):
        rows, _ = moestream_row(ckpt, args, f"{args.fraction:.0%} bank", [args.prompt_tokens], capacity=capacity,
                                host_tier="pinned" if args.device == "cuda" else "auto")
        result["rows"] += rows
    else:
        result["skipped"].append(f"{args.fraction:.0%} bank: out of time")
    record()

    if not args.no_peer:
        scratch = args.root / "hf"
        scratch.mkdir(parents=True, exist_ok=True)
        device = ["--device", "cuda:0" if args.device == "cuda" else args.device]
        if deadline.allows(60):
            result["hf_resident"] = hf_peer(ckpt, "resident", scratch, ["--prompt-tokens", str(args.prompt_tokens),
                                                                      "--gen-tokens", "32", *device],
                                            int(min(HF_RESIDENT_S, deadline.left() - 20)))
        else:
            result["skipped"].append("HF resident: out of time")
        record()
        if args.device == "cpu":
            result["skipped"].append("HF offload: needs CUDA")
        elif deadline.allows(90):
            result["hf_offload"] = hf_peer(ckpt, "offload", scratch, ["--gpu-memory", f"{budget // 2**20}MiB",
                                                                    "--prompt-tokens", "32", "--gen-tokens", "3"],
                                           int(min(HF_OFFLOAD_S, deadline.left() - 20)))
        else:
            result["skipped"].append("HF offload: out of time")
        shutil.rmtree(scratch, ignore_errors=True)
        record()
    log(table(result))


def table(result: dict) -> str:
    """One shape's rows: ours, then the peers, with our speed over theirs where they compare."""
    hf, off = result.get("hf_resident") or {}, result.get("hf_offload") or {}
    head = (f"{result['shape']} ({result['layers']} layers, {format_bytes(result['checkpoint_bytes'])} bf16)\n"
            f"| row | capacity | routing | prompt | TTFT ms | decode tok/s | hit rate | vs HF |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        peer = off if r["capacity"] < r["num_experts"] else hf
        ratio = (f"{r['decode_tok_s'] / peer['decode_tok_s']:.1f}x" if peer.get("decode_tok_s") else "–")
        lines.append(f"| moestream {r['row']} | {r['capacity']}/{r['num_experts']} | {r['routing']} | "
                     f"{r['prompt_tokens']} | {r['ttft_s'] * 1e3:.1f} | {r['decode_tok_s']:.2f} | "
                     f"{r['decode_hit_rate']:.1%} | {ratio} |")
    for name, peer in (("HF resident", hf), ("HF + accelerate offload", off)):
        if peer:
            tok_s = peer.get("decode_tok_s")
            lines.append(f"| {name} ({peer.get('experts_impl_effective')}, attn {peer.get('attn_impl_effective')}) | "
                         f"{peer.get('gpu_memory_budget') or 'all'} | model | {peer['prompt_tokens']} | "
                         f"{peer['ttft_s'] * 1e3:.1f} | {tok_s if tok_s is None else f'{tok_s:.3f}'} | – | |")
    lines += [f"skipped: {s}" for s in result["skipped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", action="append", type=parse_shape, required=True, metavar="NAME[:LAYERS]")
    ap.add_argument("--root", type=Path, default=Path("/tmp/family"), help="where checkpoints are written")
    ap.add_argument("--fraction", type=float, default=0.25, help="the bounded bank's share of each layer's experts")
    ap.add_argument("--long-prompt-tokens", type=int, default=2048, help="MLA forms are also timed after this prompt")
    ap.add_argument("--no-peer", action="store_true", help="skip HF transformers")
    ap.add_argument("--keep", action="store_true", help="keep each checkpoint")
    ap.add_argument("--budget-s", type=float, default=570, help="skip steps that would not end within this")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test, with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="shrunk shapes: a smoke test of this script")
    run_args(ap)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(args.budget_s)
    log(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch.__version__)
    results: dict = {"shapes": [], "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                     "temperature": args.temperature, "routing": "uniform (moestream); model (HF)"}

    def record() -> None:
        write_result(args.out, "family_decode", results)

    for i, (shape, layers) in enumerate(args.shape):
        result = {"shape": shape, "layers": layers, "checkpoint_bytes": 0, "rows": [], "skipped": []}
        results["shapes"].append(result)
        share = Deadline(deadline.left() / (len(args.shape) - i))   # the time left, split over the shapes left
        if not share.allows(120):
            result["skipped"].append("the whole shape: out of time")
        else:
            try:
                measure_shape(result, args, share, record)
            except Exception as exc:   # one shape failing must not lose the other's figures
                log(f"{shape} failed: {exc!r}")
                result["error"] = repr(exc)
        if not args.keep:
            shutil.rmtree(args.root / shape, ignore_errors=True)
        record()
    return 0


if __name__ == "__main__":
    sys.exit(main())
