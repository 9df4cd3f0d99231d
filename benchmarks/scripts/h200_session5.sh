#!/bin/bash
# Device runs of session 5 (issue #7), from the repo root; logs and JSON under $OUT.
#   first: GPU test of the sampling kernel (four uniforms a Philox call, base-2 logs), nano x3
#          (the first shows whether a call's first engine is still slow), step profiles at
#          batch 256 and 32 (the run's tail), the skinny-GEMM probe, one request at both shapes
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; J=$OUT; mkdir -p $J
Q=benchmarks/configs/qwen3-0.6b; L=benchmarks/configs/llama-3.1-8b
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
NANO="--num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384"
LAT="--num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048"
show() { grep -E "^==|Throughput|Start-up|Roofline|Per step|KV|preempt|ember/hf" | grep -v "^\s*$"; }
P="python3 benchmarks/scripts/profile_gpu_steps.py"
case "$1" in
first)
  python3 -m pytest -m gpu -q -x tests/kernels/test_sampling_kernel.py 2>&1 | tail -2
  for i in 1 2 3; do echo "== nano: fp8 KV, run $i =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_$i.json 2>&1 | show; done
  $P $Q --num-prompts 256 --input-len 800 --output-len 300 --skip 100 --steps 40 --kv-cache-dtype fp8 2>&1 | grep -A30 "^==" | tee $J/profile_nano_256.log
  $P $Q --num-prompts 32 --input-len 1000 --output-len 300 --skip 100 --steps 60 --kv-cache-dtype fp8 2>&1 | grep -A30 "^==" | tee $J/profile_nano_32.log
  (cd benchmarks/scripts && python3 skinny_gemm_probe.py) 2>&1 | tee $J/skinny_probe.log
  echo "== latency qwen =="; $B $Q $LAT --output-json $J/qwen_lat.json 2>&1 | show
  echo "== latency llama: warm-up =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency llama =="; $B $L $LAT --output-json $J/llama_lat.json 2>&1 | show
  $P $L --skip 60 --steps 60 2>&1 | grep -A30 "^==" | tee $J/profile_llama_1.log
  ;;
esac
