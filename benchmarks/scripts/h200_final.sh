#!/bin/bash
# Device run, all workloads of issue #7 in one call (from the repo root): nano-vllm protocol
# (plain and profiled), HF static batch for the ratio, single-request latency at both
# shapes, Llama-3.1-8B shape 512 x 1000/1000. JSON per run under $OUT/json.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; J=$OUT/json; mkdir -p $J
Q=benchmarks/configs/qwen3-0.6b; L=benchmarks/configs/llama-3.1-8b
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
NANO="--num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -m pytest -m gpu -q -s tests/kernels tests/models/test_cuda_vs_hf.py tests/runner/test_cuda_graph.py 2>&1 | grep -E "agreement|agrees|invariance|graph vs|passed|failed|Error"
echo "== nano-vllm protocol =="
$B $Q $NANO --output-json $J/nano.json 2>&1 | grep -v "^\s*$"
$B $Q $NANO --profile-steps 2>&1 | grep -E "Throughput|Per step"
echo "== HF static batch 256 x 512/256 (ember on the same prompts first) =="
$B $Q --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 1024 --max-num-seqs 256 \
  --max-num-batched-tokens 16384 --compare hf --hf-batch-size 256 --output-json $J/hf.json 2>&1 | grep -E "==|Throughput|ember/hf"
echo "== latency 128 in / 512 out =="
$B $Q --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --output-json $J/qwen_latency.json 2>&1 | grep -E "==|Throughput|Start|Roofline"
$B $Q --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --profile-steps 2>&1 | grep -E "Per step"
$B $L --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --output-json $J/llama_latency.json 2>&1 | grep -E "==|Throughput|Start|Roofline"
echo "== Llama-3.1-8B shape 512 x 1000/1000 =="
$B $L --num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 \
  --max-num-batched-tokens 16384 --output-json $J/llama.json 2>&1 | grep -v "^\s*$"
