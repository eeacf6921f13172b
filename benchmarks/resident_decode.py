"""Resident decode and prefill: moestream with every expert on the GPU, beside HF transformers on the same weights.

    python benchmarks/resident_decode.py --ckpt /tmp/q3 --out $OUT [--prompt-tokens 512 --gen-tokens 64]
        [--routing model|uniform] [--temperature 1.0] [--no-peer]

The checkpoint is written first when missing (random weights, `--shape`/`--layers`). moestream runs
`run_bench` (kernels compiled and decode graphs captured before timing); the peer is
`benchmarks/hf_baseline.py --mode resident` in its own process. Results: `$OUT/resident_decode.json`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import checkpoint_args, ensure_checkpoint, hf_peer, log, write_result  # noqa: E402

import moestream  # noqa: E402
from moestream.bench import UniformRouting, run_bench, use_routing  # noqa: E402


def main() -> None:
    ap = checkpoint_args(__doc__)
    ap.add_argument("--routing", choices=["model", "uniform"], default="uniform")
    ap.add_argument("--no-peer", action="store_true", help="skip the HF transformers peer")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_checkpoint(args.ckpt, args.shape, args.layers)
    t0 = time.perf_counter()
    engine = moestream.load(args.ckpt, device="cuda", dtype="bfloat16", max_context=4096)
    load_s = time.perf_counter() - t0
    routing = UniformRouting(engine.config.top_k, engine.device) if args.routing == "uniform" else None
    if routing is not None:
        use_routing(engine, routing)
    res = run_bench(engine, args.prompt_tokens, args.gen_tokens, load_s, temperature=args.temperature, routing=routing)
    log(res.table())
    result = {"moestream": res.as_dict(), "layers": args.layers, "shape": args.shape}
    del engine
    torch.cuda.empty_cache()
    if not args.no_peer:
        result["hf_resident"] = hf_peer(args.ckpt, "resident", args.out,
                                        ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", "32"], 400)
        if result["hf_resident"]:
            hf = result["hf_resident"]
            log(f"HF resident: decode {hf.get('decode_tok_s', 0):.2f} tok/s, TTFT {hf.get('ttft_s', 0) * 1000:.0f} ms; "
                f"ratio {res.decode_tok_s / max(hf.get('decode_tok_s', 1e-9), 1e-9):.1f}x")
    write_result(args.out, "resident_decode", result)


if __name__ == "__main__":
    main()
