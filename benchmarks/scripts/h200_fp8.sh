#!/bin/bash
# Device runs for the fp8 KV cache (issue #7), from the repo root, in two calls of < 300 s:
#   part 1: the GPU kernel tests, the nano-vllm protocol with --kv-cache-dtype auto vs fp8,
#           the decode-attention kernel alone (bf16 vs fp8 cache);
#   part 2: the engine GPU tests (CUDA graphs, HF), both nano runs profiled, Llama-3.1-8B
#           shape 512 x 1000/1000 with fp8.
# JSON per run under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
Q=benchmarks/configs/qwen3-0.6b; L=benchmarks/configs/llama-3.1-8b
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
NANO="--num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384"
KEEP="Throughput|Start|KV cache|Per step|memory|Error|error"
if [ "${1:-1}" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  timeout 130 python3 -m pytest -m gpu -q tests/kernels 2>&1 | tail -15
  for kv in auto fp8; do
    echo "== nano, --kv-cache-dtype $kv"
    timeout 45 $B $Q $NANO --kv-cache-dtype $kv --output-json $OUT/nano_$kv.json 2>&1 | grep -E "$KEEP"
  done
  timeout 30 python3 benchmarks/scripts/decode_fp8.py
else
  timeout 110 python3 -m pytest -m gpu -q -s tests/runner/test_cuda_graph.py tests/models/test_cuda_vs_hf.py 2>&1 \
    | grep -E "agreement|agrees|invariance|graph vs|fp8 KV|passed|failed|Error|FAILED"
  for kv in auto fp8; do
    echo "== nano profiled, --kv-cache-dtype $kv"
    timeout 40 $B $Q $NANO --kv-cache-dtype $kv --profile-steps 2>&1 | grep -E "$KEEP"
  done
  echo "== Llama-3.1-8B shape 512 x 1000/1000, --kv-cache-dtype fp8"
  timeout 100 $B $L --num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 \
    --max-num-batched-tokens 16384 --kv-cache-dtype fp8 --output-json $OUT/llama_fp8.json 2>&1 | grep -E "$KEEP"
fi
