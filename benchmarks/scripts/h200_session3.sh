#!/bin/bash
# Device run of session 3 (issue #7), from the repo root: GPU tests, then every workload
# with async scheduling and the KV-cache dtype varied where they matter. JSON under $OUT.
#   part 1: tests, nano-vllm protocol (4 variants), single-request latency (both shapes)
#   part 2: HF static batch for the ratio, Llama-3.1-8B shape 512 x 1000/1000 (fp8 and auto KV)
source benchmarks/scripts/h200_env.sh
if [ "${1:-1}" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -m pytest -m gpu -q -s tests/kernels tests/models/test_cuda_vs_hf.py tests/runner 2>&1 | grep -E "agreement|agrees|invariance|graph vs|passed|failed|Error" | tail -12
  echo "== nano: async, bf16 KV =="; $B $Q $NANO --output-json $J/nano_async.json 2>&1 | show
  echo "== nano: async, fp8 KV =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_async_fp8.json 2>&1 | show
  echo "== nano: sync, bf16 KV =="; $B $Q $NANO --no-async-scheduling --output-json $J/nano_sync.json 2>&1 | show
  echo "== nano: async, fp8 KV, profiled =="; $B $Q $NANO --kv-cache-dtype fp8 --profile-steps 2>&1 | show
  echo "== latency qwen: async =="; $B $Q $LAT --output-json $J/qwen_lat_async.json 2>&1 | show
  echo "== latency qwen: sync =="; $B $Q $LAT --no-async-scheduling 2>&1 | show
  echo "== latency qwen: async, profiled =="; $B $Q $LAT --profile-steps 2>&1 | show
  echo "== latency llama: async =="; $B $L $LAT --output-json $J/llama_lat_async.json 2>&1 | show
  echo "== latency llama: sync =="; $B $L $LAT --no-async-scheduling 2>&1 | show
fi
if [ "${1:-2}" = 2 ]; then
  # the first Llama-8B engine of a call has been slow every time (runs 4, 6 and part 1): twice
  echo "== latency llama: async (first 8B engine of the call) =="; $B $L $LAT 2>&1 | show
  echo "== latency llama: async, again =="; $B $L $LAT --output-json $J/llama_lat_async2.json 2>&1 | show
  echo "== latency llama: sync, again =="; $B $L $LAT --no-async-scheduling 2>&1 | show
  echo "== HF static batch 256 x 512/256 (ember async fp8 on the same prompts first) =="
  $B $Q --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 1024 --max-num-seqs 256 \
    --max-num-batched-tokens 16384 --kv-cache-dtype fp8 --compare hf --hf-batch-size 256 --output-json $J/hf.json 2>&1 | show
  LL="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
  echo "== Llama-3.1-8B 512 x 1000/1000: async, fp8 KV =="; $B $L $LL --kv-cache-dtype fp8 --output-json $J/llama_fp8.json 2>&1 | show
  echo "== Llama-3.1-8B 512 x 1000/1000: async, bf16 KV =="; $B $L $LL --output-json $J/llama_auto.json 2>&1 | show
fi
