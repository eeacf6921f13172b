#!/usr/bin/env bash
# GPU call 3: GPU tests, budget sweep with segmented fetch graphs and sampled (diverse) decode.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/gpu_tests.txt
python3 scripts/make_random_checkpoint.py --shape qwen3-30b-a3b --layers 24 --dtype bf16 --out /tmp/q3 --device cuda | tail -1
timeout 400 python3 benchmarks/gpu_suite.py --phase budgets --ckpt /tmp/q3 --layers 24 --out $OUT --prompt-tokens 512 --gen-tokens 64 --temperature 1.0 2>&1 | grep -v "Loading\|it/s\]" | tail -40
