#!/usr/bin/env bash
# GPU call 2: GPU tests, decode profile, budget sweep with HF offload peer.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 240 python3 -m pytest -q tests/kernels tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
python3 scripts/make_random_checkpoint.py --shape qwen3-30b-a3b --layers 24 --dtype bf16 --out /tmp/q3 --device cuda | tail -1
timeout 120 python3 benchmarks/profile_decode.py /tmp/q3 --steps 16 2>&1 | tee $OUT/profile.txt | head -50
timeout 420 python3 benchmarks/gpu_suite.py --phase budgets --ckpt /tmp/q3 --layers 24 --out $OUT --prompt-tokens 512 --gen-tokens 64 --hf-offload 2>&1 | grep -v "Loading\|it/s\]" | tail -40
