#!/bin/bash
# Device runs for FP8 weights (issue #17), from the repo root, one mode a call; logs and JSON
# under $OUT (gathered into $OUT/fp8.tgz). Each mode fits one call (< 10 min).
#   tests:   the GPU tests of the FP8 kernels (and the GEMV they extend), and the engine with FP8
#            weights against its bf16 self (logits, greedy agreement, CUDA graphs): the numbers
#            they print are the report
#   kernels: fp8_gemm_bench.py --sweep: bf16 cuBLAS vs the fp8 GEMV vs quantize + _scaled_mm vs
#            the Triton matmuls at the Llama-8B shapes, M = 1 .. 2048; the last line says what
#            FP8_GEMV_MAX_ROWS (layers/kernel_paths.py, 4 now) should be
#   ember:   ember bench throughput at the Llama-3.1-8B shape, dummy weights, fp8 KV cache:
#            512 x 1000/1000 (--max-num-seqs 512 --max-num-batched-tokens 16384
#            --max-model-len 2048) and one request 128/512, with --quantization fp8, then the
#            same two with bf16 weights (the baseline)
#   vllm:    vLLM 0.24 on the same requests (vllm_race.py: ember's random_requests) with
#            quantization="fp8", kv_cache_dtype="fp8". Stage vLLM first as
#            /work/shared/peers/vllm-gpu/stage says (its parts copied into /root/st by the calls
#            before), and carry the last part (.vllm-s5) in this call.
source benchmarks/scripts/h200_env.sh
J=/tmp/fp8; mkdir -p $J
pack() { tar czf $OUT/fp8.tgz -C $J .; }
LL="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "$1" in
tests)
  timeout 540 python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_fp8_kernels.py tests/kernels/test_gemv.py \
    tests/models/test_cuda_fp8.py 2>&1 \
    | grep -E "agreement|agrees|graph|weights:|mean \|diff\||passed|failed|Error|^E |FAILED|\.py:[0-9]+" | tail -40 \
    | tee $J/gpu_tests.log
  pack
  ;;
kernels)
  (cd benchmarks/scripts && timeout 540 python3 fp8_gemm_bench.py --sweep) 2>&1 | tee $J/fp8_gemm_bench.log
  pack
  ;;
ember)
  for w in fp8 bf16; do
    q=$([ $w = fp8 ] && echo "--quantization fp8" || echo "--quantization none")
    echo "== Llama-3.1-8B shape 512 x 1000/1000, $w weights, fp8 KV =="
    timeout 200 $B $L $LL --kv-cache-dtype fp8 $q --output-json $J/llama_${w}.json 2>&1 | show | tee -a $J/ember.log
    echo "== Llama-3.1-8B shape, one request 128/512, $w weights, fp8 KV =="
    timeout 60 $B $L $LAT --kv-cache-dtype fp8 $q --output-json $J/llama_latency_${w}.json 2>&1 | show | tee -a $J/ember.log
    pack
  done
  ;;
vllm)
  S=${VLLM_STAGE:-.vllm-s5}
  if [ ! -x $S/run-on-device ]; then
    echo "vLLM is not staged here ($S/run-on-device): run /work/shared/peers/vllm-gpu/stage, then the calls it names"
    exit 1
  fi
  $S/run-on-device none  # puts the last part beside the others and installs vLLM into /tmp/vllm-site; runs no workload
  VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/vllm-site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    timeout 540 python3 benchmarks/scripts/vllm_race.py throughput latency --weights fp8 --kv-cache-dtype fp8 2>&1 | grep -E "^RESULT|Error|error:" \
    | tee $J/vllm_fp8.log
  pack
  ;;
*)
  echo "usage: $0 tests | kernels | ember | vllm"; exit 2
  ;;
esac
