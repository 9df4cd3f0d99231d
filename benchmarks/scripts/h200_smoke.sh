#!/bin/bash
# Device smoke test: the GPU kernel tests and one small engine run (run from the repo root).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -m pytest -m gpu -q -x tests/kernels 2>&1 | tail -15
python3 -m ember.server.cli bench throughput benchmarks/configs/qwen3-0.6b --load-format dummy --num-prompts 32 \
  --input-len 256 --output-len 128 --max-model-len 1024 --max-num-seqs 32 --profile-steps 2>&1 | tail -25
