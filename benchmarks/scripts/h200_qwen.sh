#!/bin/bash
# Device run, Qwen3-0.6B shape: GPU tests, nano-vllm protocol, single-request latency, HF ratio.
# From the repo root; results land in $OUT (log + one JSON per run, merged into results.jsonl).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; J=$OUT/json; mkdir -p $J
Q=benchmarks/configs/qwen3-0.6b
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
[ "$SKIP_TESTS" = 1 ] || python3 -m pytest -m gpu -q -s tests/kernels tests/models/test_cuda_vs_hf.py tests/runner/test_cuda_graph.py 2>&1 | grep -v "^\s*$" | tail -30
echo "== nano-vllm protocol: 256 seqs, in/out U[100,1024] =="
$B $Q --num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 \
  --max-num-seqs 256 --max-num-batched-tokens 16384 --output-json $J/nano.json 2>&1 | grep -v "^\s*$"
echo "== nano-vllm protocol, profiled (syncs after each phase) =="
$B $Q --num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 \
  --max-num-seqs 256 --max-num-batched-tokens 16384 --profile-steps --output-json $J/nano_profile.json 2>&1 | grep -E "Throughput|Per step"
echo "== latency: one request 128 in / 512 out =="
$B $Q --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --output-json $J/qwen_latency.json 2>&1 | grep -v "^\s*$"
$B $Q --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --profile-steps 2>&1 | grep -E "Throughput|Per step"
echo "== HF static batch: 256 x 512 in / 256 out, ember on the same prompts =="
$B $Q --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 1024 --max-num-seqs 256 \
  --max-num-batched-tokens 16384 --compare hf --hf-batch-size 256 --output-json $J/hf.json 2>&1 | grep -v "^\s*$"
for f in $J/*.json; do python3 -c "import json,sys; print(json.dumps(json.load(open('$f'))))"; done > $OUT/results.jsonl
rm -rf $J
