"""Quality of quantized formats: perplexity and KL divergence to full precision on the demo model's held-out code.

    python benchmarks/quant_quality.py [--formats int8 int4-g32 int4 ...] [--json out.json] [--device cpu]

For each format: experts only, then experts + shared + attention at the same bits (embeddings and
routers stay at full precision). Sliding-window perplexity (window = the model's context, stride
half of it) over `moestream/demo_model/heldout_sample.txt`, and the mean KL(full ‖ quantized) of the
next-token distributions at the same positions — the numbers of `moestream perplexity
--kl-reference`, with the reference loaded once. Routing: the trained demo model's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moestream  # noqa: E402
from moestream.cli import DEMO_MODEL  # noqa: E402
from moestream.runtime.perplexity import sliding_window_scores  # noqa: E402

FORMATS = ["int8", "int4-g32", "int4", "int4-g128", "nf4", "int3", "nf3", "int2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    reference = moestream.load(DEMO_MODEL, device=args.device, dtype="float32")
    text = (DEMO_MODEL / "heldout_sample.txt").read_text()
    ids = reference.tokenizer(text, add_special_tokens=False).input_ids
    window = reference.max_context
    t0 = time.perf_counter()
    base = sliding_window_scores(reference.logits, ids, window, reference.device)
    rows = [{"format": "full precision (bf16 weights)", "classes": "-", "perplexity": base.perplexity, "kl": 0.0,
             "seconds": time.perf_counter() - t0}]
    print(json.dumps(rows[-1]), flush=True)
    for fmt in args.formats:
        for classes, kw in (("experts", {"experts": fmt}),
                            ("experts+shared+attention", {"experts": fmt, "shared": fmt, "attention": fmt})):
            t0 = time.perf_counter()
            engine = moestream.load(DEMO_MODEL, device=args.device, dtype="float32", **kw)
            scores = sliding_window_scores(engine.logits, ids, window, engine.device, reference.logits)
            rows.append({"format": engine.bank.formats[0].name, "classes": classes, "perplexity": scores.perplexity,
                         "vs_full": scores.perplexity / base.perplexity - 1, "kl": scores.kl,
                         "seconds": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
            del engine
    print("\n| format | quantized | perplexity | vs full | KL (nats/token) |\n|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['vs_full']:+.1%}" if "vs_full" in r else "–"
        print(f"| {r['format']} | {r['classes']} | {r['perplexity']:.3f} | {vs} | {r['kl']:.4f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
