#!/bin/bash
# Device run: decode-kernel sweep, Llama-3.1-8B shape throughput and latency, then the
# Qwen3-0.6B runs again with the sweep's best decode config. From the repo root.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; J=$OUT/json; mkdir -p $J
Q=benchmarks/configs/qwen3-0.6b; L=benchmarks/configs/llama-3.1-8b
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
python3 benchmarks/scripts/decode_sweep.py 2>&1 | tee $OUT/sweep.txt
BEST=$(grep BEST_QWEN $OUT/sweep.txt | cut -d= -f2)
echo "== Llama-3.1-8B shape: 512 x 1000 in / 1000 out =="
$B $L --num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 \
  --max-num-batched-tokens 16384 --output-json $J/llama.json 2>&1 | grep -v "^\s*$"
echo "== Llama latency: one request 128 in / 512 out (profiled run second) =="
$B $L --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --output-json $J/llama_latency.json 2>&1 | grep -v "^\s*$"
$B $L --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --profile-steps 2>&1 | grep -E "Throughput|Per step"
echo "== nano-vllm protocol again, decode config $BEST =="
export EMBER_DECODE_CONFIG=$BEST
$B $Q --num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 \
  --max-num-seqs 256 --max-num-batched-tokens 16384 --output-json $J/nano2.json 2>&1 | grep -v "^\s*$"
$B $Q --num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 \
  --max-num-seqs 256 --max-num-batched-tokens 16384 --profile-steps 2>&1 | grep -E "Throughput|Per step"
$B $Q --num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048 --output-json $J/qwen_latency2.json 2>&1 | grep -E "Throughput|Start"
echo "== Llama throughput, profiled =="
$B $L --num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 \
  --max-num-batched-tokens 16384 --profile-steps 2>&1 | grep -E "Throughput|Per step"
