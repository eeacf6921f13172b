#!/usr/bin/env bash
# GPU call 7: trace replay of the demo model's routing at 25/15% (prefetch on/off), prepacked warm
# start vs cold start, next-layer prefetch on the demo model itself.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 scripts/make_random_checkpoint.py --shape qwen3-30b-a3b --layers 24 --dtype bf16 --out /tmp/q3 --device cuda | tail -1
timeout 260 python3 benchmarks/gpu_suite.py --phase budgets --ckpt /tmp/q3 --layers 24 --out $OUT --fractions 0.25 0.15 \
  --prefetch both --routing trace --trace benchmarks/traces/demo_heldout_trace.json --temperature 0 \
  --prompt-tokens 256 --gen-tokens 128 2>&1 | grep -v "Loading\|it/s\]" | tail -14
for run in cold warm; do
  timeout 120 python3 -m moestream bench /tmp/q3 --gpu-memory 9781MiB --host-tier disk --prepack /tmp/prepack \
    --prompt-tokens 64 --gen-tokens 16 --max-context 4096 --json $OUT/start_$run.json --verbose 2>&1 | grep -E "moestream\]|load |decode " 
done
timeout 120 python3 benchmarks/demo_prefetch.py --device cuda --capacity 32 16 --json $OUT/demo_prefetch.json 2>&1 | cut -c1-220
