#!/usr/bin/env bash
# GPU call 9: pinning under trace replay (the demo profile's top-8 experts per layer, layers mapped
# modulo), 25% and 15% budgets, no prefetch.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 scripts/make_random_checkpoint.py --shape qwen3-30b-a3b --layers 24 --dtype bf16 --out /tmp/q3 --device cuda | tail -1
timeout 300 python3 benchmarks/gpu_suite.py --phase budgets --ckpt /tmp/q3 --out $OUT --fractions 0.25 0.15 --prefetch off \
  --pin-profile benchmarks/traces/demo_heldout_profile.json --pin-top-k 8 \
  --routing trace --trace benchmarks/traces/demo_heldout_trace.json --temperature 0 --prompt-tokens 256 --gen-tokens 128 \
  2>&1 | grep -E "^---|^\{" | cut -c1-400
