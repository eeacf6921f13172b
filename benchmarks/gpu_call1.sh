#!/usr/bin/env bash
# GPU call 1: kernel + GPU tests, kernel micro-benchmark, foundation benchmark vs HF resident.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/env.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/env.txt
timeout 200 python3 -m pytest -q -x tests/kernels tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/gpu_tests.txt
timeout 120 python3 benchmarks/bench_fused_moe.py --json $OUT/fused_moe.json 2>&1 | tail -20
timeout 400 python3 benchmarks/gpu_suite.py --phase foundation --ckpt /tmp/q3 --layers 24 --out $OUT --prompt-tokens 512 --gen-tokens 64 2>&1 | grep -v "Loading\|it/s\]" | tail -40
