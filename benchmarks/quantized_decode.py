"""Quantized experts end to end: convert a checkpoint, then decode resident and at memory budgets.

    python benchmarks/quantized_decode.py --ckpt /tmp/q3 --out $OUT [--formats int4 int8 int3]
        [--fractions 1.0 0.25] [--routing uniform|trace --trace T.json] [--prompt-tokens 512 --gen-tokens 64]
        [--miss-policy fetch hybrid] [--cpu-misses 0 1 auto] [--dense int4]

For each format: `moestream convert` (timed: GB/s of source expert weights) into /tmp/<ckpt>-<format>
(with --dense F, the attention and the embeddings and LM head in F too, as a Q4_0 GGUF quantizes
them: /tmp/<ckpt>-<format>-dense-<F>) unless it is there, then `moestream.load` of the packed checkpoint at each fraction of the experts
on the GPU (capacity = fraction × E, at least top-k, or 1 with the hybrid policy: fraction 0 keeps
every expert off the GPU; the rest in pinned host RAM) and `run_bench`. The first load
of each packed checkpoint is its cold start (page cache warm from the convert). Routing stated per
row. Results: `$OUT/quantized_decode.json`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import checkpoint_args, ensure_checkpoint, log, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.bench import apply_routing, run_bench  # noqa: E402
from moestream.engine.convert import convert  # noqa: E402
from moestream.quant.recipe import QuantRecipe  # noqa: E402


def main() -> None:
    ap = checkpoint_args(__doc__)
    ap.add_argument("--formats", nargs="+", default=["int4"])
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--routing", choices=["model", "uniform", "trace"], default="uniform")
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--cpu-misses", type=lambda t: t if t == "auto" else float(t), nargs="+", default=[0.0],
                    help="at bounded budgets (the pinned host tier), the CPU's share of the misses: each value is "
                         "a row (with the hybrid policy 0 means its default)")
    ap.add_argument("--miss-policy", nargs="+", default=["fetch"], choices=["fetch", "hybrid"],
                    help="miss policies at bounded budgets: each is a row")
    ap.add_argument("--dense", default=None,
                    help="also quantize the attention, the embeddings and the LM head in this format")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_checkpoint(args.ckpt, args.shape, args.layers)
    rows = []
    for fmt in args.formats:
        packed = Path(f"/tmp/{args.ckpt.name}-{fmt}" + (f"-dense-{args.dense}" if args.dense else ""))
        recipe = QuantRecipe(experts=fmt, attention=args.dense, embeddings=args.dense)
        conv = None
        if not (packed / "layout.json").exists():
            result = convert(args.ckpt, packed, recipe, progress=False, device="cuda")
            conv = {"seconds": result.seconds, "GB_per_s": result.gb_per_s, "written_GB": result.written_bytes / 1e9}
            log(f"convert {fmt}: {json.dumps(conv)}")
        first = True
        config = json.loads((args.ckpt / "config.json").read_text())
        E, top_k = config.get("num_experts", 128), config.get("num_experts_per_tok", 8)
        runs = [(f, c, m) for f in args.fractions for m in args.miss_policy for c in args.cpu_misses]
        resident_done = False
        for frac, cpu_misses, policy in runs:
            cap = max(1 if policy == "hybrid" else top_k, round(E * frac))
            if cap == E:
                if resident_done:
                    continue   # nothing misses: one resident row is enough
                resident_done, policy, cpu_misses = True, "fetch", 0.0
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if cap == E:
                kw = {}
            elif policy == "hybrid":
                kw = dict(host_tier="pinned", miss_policy="hybrid", cpu_misses=cpu_misses or None)
            else:
                kw = dict(host_tier="pinned", miss_policy="fetch", cpu_misses=cpu_misses) if cpu_misses else {}
            engine = moestream.load(packed, device="cuda", dtype="bfloat16", capacity=cap, max_context=4096, **kw)
            load_s = time.perf_counter() - t0
            routing = apply_routing(engine, args.routing, args.trace)
            res = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s, temperature=args.temperature,
                            routing=routing).as_dict()
            res.update(format=engine.bank.formats[0].name, dense=args.dense, expert_fraction=frac, cold_start=first, convert=conv,
                       cpu_misses=cpu_misses, miss_policy=engine.bank.miss_policy)
            res["host_gb_s"] = (res["decode_bytes_per_token"] + res["decode_cpu_bytes_per_token"]
                                + res["decode_host_read_bytes_per_token"]) * res["decode_tok_s"] / 1e9
            rows.append(res)
            log(json.dumps({k: res[k] for k in ("format", "dense", "capacity", "routing", "miss_policy", "cpu_misses",
                                                "decode_tok_s", "ttft_s", "prefill_tok_s", "decode_hit_rate",
                                                "decode_bytes_per_token", "decode_cpu_bytes_per_token",
                                                "decode_host_read_bytes_per_token", "decode_cpu_busy_s_per_token",
                                                "host_gb_s", "peak_device_bytes",
                                                "load_s")}))
            first, conv = False, None
            engine.close()
            del engine
            torch.cuda.empty_cache()
    write_result(args.out, "quantized_decode", {"rows": rows, "layers": args.layers})


if __name__ == "__main__":
    main()
