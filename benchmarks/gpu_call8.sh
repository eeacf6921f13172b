#!/usr/bin/env bash
# GPU call 8: prefetch under trace replay with the demo model's measured prediction accuracy (0.65),
# adaptive prefetch off-switch with an uninformative predictor, cold vs prepacked warm start.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 scripts/make_random_checkpoint.py --shape qwen3-30b-a3b --layers 24 --dtype bf16 --out /tmp/q3 --device cuda | tail -1
T="--routing trace --trace benchmarks/traces/demo_heldout_trace.json --temperature 0 --prompt-tokens 256 --gen-tokens 128"
timeout 240 python3 benchmarks/gpu_suite.py --phase budgets --ckpt /tmp/q3 --out $OUT/replay65 --fractions 0.25 0.15 \
  --prefetch both --trace-prediction-accuracy 0.65 $T 2>&1 | grep -E "^---|^\{" | cut -c1-400
timeout 120 python3 benchmarks/gpu_suite.py --phase budgets --ckpt /tmp/q3 --out $OUT/replay_router --fractions 0.25 \
  --prefetch on $T 2>&1 | grep -E "^---|^\{" | cut -c1-400
for run in cold warm; do
  timeout 120 python3 -m moestream bench /tmp/q3 --gpu-memory 9781MiB --host-tier disk --prepack /tmp/prepack \
    --prompt-tokens 64 --gen-tokens 16 --max-context 4096 --json $OUT/start_$run.json --verbose 2>&1 | grep -E "moestream\]|load |decode "
done
