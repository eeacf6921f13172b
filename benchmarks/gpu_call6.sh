#!/usr/bin/env bash
# GPU call 6: kernel + GPU tests, fused-MoE micro-benchmark (both paths), budget sweep under uniform routing.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 170 python3 -m pytest -q tests/kernels tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -8 | tee $OUT/gpu_tests.txt
timeout 100 python3 benchmarks/bench_fused_moe.py --tokens 1 2 4 8 32 512 --peers-max-tokens 1 --json $OUT/fused_moe.json 2>&1 | tail -40 | tee $OUT/fused_moe_bench.txt
python3 scripts/make_random_checkpoint.py --shape qwen3-30b-a3b --layers 24 --dtype bf16 --out /tmp/q3 --device cuda | tail -1
timeout 280 python3 benchmarks/gpu_suite.py --phase budgets --ckpt /tmp/q3 --layers 24 --out $OUT --prompt-tokens 512 --gen-tokens 64 --temperature 1.0 --routing uniform 2>&1 | grep -v "Loading\|it/s\]" | tail -30
