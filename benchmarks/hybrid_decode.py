"""Qwen3-Next's hybrid shape end to end: batch-1 decode resident and at banks holding 25% and 10% of the experts, prefill at 4K tokens, beside HF transformers.

    python benchmarks/hybrid_decode.py --ckpt /tmp/qnext --out $OUT [--layers 12]
        [--prompt-tokens 4096 --gen-tokens 64] [--fractions 1 0.25 0.1] [--no-peer] [--hf-offload]

The checkpoint (written when missing, random weights) has the real Qwen3-Next-80B-A3B config: 512
experts of width 512, top-10 and a gated shared expert in every layer, three of every four layers
Gated DeltaNet and the fourth gated attention. The whole model is 160 GB in bf16; 12 of its 48
layers (9 linear-attention + 3 full-attention, 40.8 GB) fit the GPU host's 64 GiB disk and its
pinned host tier. `--layers` must be a multiple of 4, so the 3:1 pattern is kept.

moestream's rows are `budget_sweep.budgets`: each budget is what `plan_memory` says its capacity
needs, one pinned host tier holds every expert and is shared by the bounded banks, fetch (exact),
LCP, no prefetch, uniform routing (k distinct experts per token drawn on the device: the bank's
worst case, hit rate = capacity / E), sampled at temperature 1. The prompt is `--prompt-tokens`
long, so each row's TTFT is its prefill at that length and its decode runs at that context. The
peer is `hf_baseline.py --mode resident` (the whole checkpoint fits the GPU; the model's own
routing, greedy: at full residency routing changes which experts are read, not how many);
`--hf-offload` adds HF + accelerate offload at the 25% budget (slow: a separate command). With
fla-core installed both engines run flash-linear-attention's gated delta rule; the JSON says
which kernels ran. Results: `$OUT/hybrid_decode.json` (the HF records also as `$OUT/hf_*.json`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.budget_sweep import budgets  # noqa: E402
from benchmarks.common import checkpoint_args, ensure_checkpoint, hf_peer, log, write_result  # noqa: E402

from moestream.kernels.delta_rule import fla_available  # noqa: E402

SHAPE = "qwen3-next-80b-a3b"


def parse_args(argv=None):
    ap = checkpoint_args(__doc__)
    ap.set_defaults(shape=SHAPE, layers=12, prompt_tokens=4096, gen_tokens=64)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25, 0.1])
    ap.add_argument("--no-peer", action="store_true", help="skip the HF transformers resident peer")
    ap.add_argument("--hf-offload", action="store_true", help="add HF + accelerate offload at the 25%% budget")
    args = ap.parse_args(argv)
    if args.layers % 4:
        ap.error(f"--layers {args.layers} breaks the 3:1 linear/full pattern; give a multiple of 4.")
    # what budget_sweep.budgets reads, at its defaults: exact fetch, LCP, no prefetch, uniform routing
    args.routing, args.trace, args.trace_prediction_accuracy = "uniform", None, None
    args.prefetch, args.residency, args.cpu_misses = "off", "lcp", [0.0]
    args.pin_profile, args.pin_top_k = None, 0
    args.max_context = args.prompt_tokens + args.gen_tokens
    return args


def delta_rule_kernels() -> str:
    """Which gated delta rule this process runs on the GPU in bf16."""
    if not fla_available():
        return "torch reference"
    import fla

    return f"flash-linear-attention (fla-core {fla.__version__})"


def table(result: dict) -> str:
    """One row per engine and budget: the numbers the issue asks for."""
    head = ("engine", "experts on GPU", "decode tok/s", f"prefill tok/s ({result['prompt_tokens']})", "TTFT ms",
            "decode hit rate", "GB moved/token", "peak GPU GiB")
    rows = []
    for key, res in result.items():
        if not key.startswith("moestream_"):
            continue
        rows.append(("moestream", f"{res['capacity']}/{res['num_experts']} ({res['expert_fraction']:.0%})",
                     f"{res['decode_tok_s']:.2f}", f"{res['prefill_tok_s']:.0f}", f"{res['ttft_s'] * 1e3:.0f}",
                     f"{res['decode_hit_rate']:.1%}", f"{res['decode_bytes_per_token'] / 1e9:.3f}",
                     f"{res['peak_device_bytes'] / 2**30:.2f}"))
    for key, label in (("hf_resident", "HF resident"), ("hf_offload_25", "HF offload (25% budget)")):
        hf = result.get(key)
        if hf:
            tok_s = hf.get("decode_tok_s")
            rows.append((label, "all" if key == "hf_resident" else f"{hf.get('gpu_memory_budget')} budget",
                         f"{tok_s:.2f}" if tok_s else "n/a", f"{hf['prompt_tokens'] / hf['ttft_s']:.0f}",
                         f"{hf['ttft_s'] * 1e3:.0f}", "-", "-", f"{hf.get('peak_alloc_gib') or 0:.2f}"))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [head, *rows])


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    kernels = delta_rule_kernels()
    log(torch.cuda.get_device_name(), torch.__version__, f"gated delta rule: {kernels}")
    ensure_checkpoint(args.ckpt, args.shape, args.layers)
    result = {"shape": args.shape, "layers": args.layers, "prompt_tokens": args.prompt_tokens,
              "gen_tokens": args.gen_tokens, "routing": "uniform (moestream), model (HF)", "delta_rule": kernels}
    result.update(budgets(args))
    torch.cuda.empty_cache()
    if not args.no_peer:
        result["hf_resident"] = hf_peer(args.ckpt, "resident", args.out,
                                        ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", "32"], 420)
    log(table(result))
    full, hf = result.get("moestream_100"), result.get("hf_resident")
    if full and hf and hf.get("decode_tok_s"):
        log(f"resident against HF: decode {full['decode_tok_s'] / hf['decode_tok_s']:.1f}x, "
            f"prefill {full['prefill_tok_s'] / (hf['prompt_tokens'] / hf['ttft_s']):.1f}x")
    write_result(args.out, "hybrid_decode", result)


if __name__ == "__main__":
    main()
