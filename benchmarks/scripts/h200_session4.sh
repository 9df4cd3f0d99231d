#!/bin/bash
# Device runs of session 4 (issue #7), from the repo root; logs and JSON under $OUT.
#   gemv:  GPU tests of the GEMV kernel and the HF comparison, the GEMV micro-benchmark,
#          one request at both shapes with the GEMV path on and off, step profiles at batch 1
#   attn:  the decode-attention variants sweep (variants since reverted), the batch-1 and
#          nano-vllm step profiles, one request at both shapes
#   probe: GPU tests of the sliced sampling kernel, the KV-layout probe, one request at both
#          shapes after the sampling fix, the batch-1 step profile
#   final: GPU tests, the nano-vllm protocol (fp8 KV; 128-token blocks, the new CUDA default,
#          and 16 for comparison), Llama-8B 512 x 1000/1000 (fp8 KV), HF's static batch
#   again: after bf16 logits into the sampler and more sampling slices: GPU tests of what
#          changed, a short warm-up engine, then nano x2, one request at both shapes, Llama-8B
#   blocks: Llama-8B 512 x 1000/1000 fp8 with 128-token blocks, 16-token blocks, 128 again
#   last:  after the KV write moved into the RoPE kernel: GPU tests of what changed, nano x3
#          (the first as warm-up), one request at both shapes
source benchmarks/scripts/h200_env.sh
case "$1" in
gemv)
  python3 -m pytest -m gpu -q -s -x tests/kernels/test_gemv.py tests/models/test_cuda_vs_hf.py 2>&1 | grep -E "agreement|agrees|invariance|passed|failed|Error" | tail -12
  python3 benchmarks/scripts/gemv_bench.py --sweep 2>&1 | tee $J/gemv_bench.log
  echo "== latency qwen: first engine of the call (throwaway) =="; $B $Q $LAT 2>&1 | show
  echo "== latency qwen: gemv =="; $B $Q $LAT --output-json $J/qwen_lat_gemv.json 2>&1 | show
  echo "== latency qwen: cuBLAS =="; EMBER_SMALL_BATCH_GEMV=0 $B $Q $LAT 2>&1 | show
  echo "== latency llama: gemv =="; $B $L $LAT --output-json $J/llama_lat_gemv.json 2>&1 | show
  echo "== latency llama: cuBLAS =="; EMBER_SMALL_BATCH_GEMV=0 $B $L $LAT 2>&1 | show
  $P $Q --skip 60 --steps 100 2>&1 | grep -A30 "^==" | tee $J/profile_qwen_1.log
  $P $L --skip 60 --steps 60 2>&1 | grep -A30 "^==" | tee $J/profile_llama_1.log
  ;;
attn)
  # (this call first ran benchmarks/scripts/decode_variants.py, reverted with the variants)
  $P $Q --output-len 400 --skip 60 --steps 100 2>&1 | grep -A30 "^==" | tee $J/profile_qwen_1.log
  echo "== latency qwen: gemv =="; $B $Q $LAT --output-json $J/qwen_lat_gemv.json 2>&1 | show
  echo "== latency llama: throwaway =="; $B $L $LAT 2>&1 | show
  echo "== latency llama: gemv (o_proj only) =="; $B $L $LAT --output-json $J/llama_lat_gemv.json 2>&1 | show
  $P $Q --num-prompts 256 --input-len 800 --output-len 300 --skip 100 --steps 40 --kv-cache-dtype fp8 2>&1 | grep -A30 "^==" | tee $J/profile_nano_fp8.log
  ;;
probe)
  python3 -m pytest -m gpu -q -x tests/kernels/test_sampling_kernel.py tests/kernels/test_gemv.py 2>&1 | tail -2
  python3 benchmarks/scripts/kv_layout_probe.py 2>&1 | tee $J/kv_layout_probe.log
  echo "== latency qwen: throwaway =="; $B $Q --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency qwen =="; $B $Q $LAT --output-json $J/qwen_lat.json 2>&1 | show
  echo "== latency qwen, again =="; $B $Q $LAT 2>&1 | show
  echo "== latency llama: throwaway =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency llama =="; $B $L $LAT --output-json $J/llama_lat.json 2>&1 | show
  $P $Q --output-len 400 --skip 60 --steps 100 2>&1 | grep -A30 "^==" | tee $J/profile_qwen_1.log
  ;;
final)
  python3 -m pytest -m gpu -q -s tests/kernels tests/models/test_cuda_vs_hf.py tests/runner 2>&1 | grep -E "agreement|agrees|invariance|graph vs|passed|failed|Error" | tail -12
  echo "== nano: fp8 KV, block 128 =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_b128.json 2>&1 | show
  echo "== nano: fp8 KV, block 128, again =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_b128_2.json 2>&1 | show
  echo "== nano: fp8 KV, block 16 =="; $B $Q $NANO --kv-cache-dtype fp8 --block-size 16 --output-json $J/nano_fp8_b16.json 2>&1 | show
  LL="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
  echo "== Llama-3.1-8B 512 x 1000/1000: fp8 KV, block 128 =="; $B $L $LL --kv-cache-dtype fp8 --output-json $J/llama_fp8_b128.json 2>&1 | show
  echo "== HF static batch 256 x 512/256 (ember fp8 on the same prompts first) =="
  $B $Q --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 1024 --max-num-seqs 256 \
    --max-num-batched-tokens 16384 --kv-cache-dtype fp8 --compare hf --hf-batch-size 256 --output-json $J/hf.json 2>&1 | show
  ;;
again)
  python3 -m pytest -m gpu -q -s tests/kernels/test_sampling_kernel.py tests/models/test_cuda_vs_hf.py 2>&1 | grep -E "agreement|agrees|passed|failed|Error" | tail -8
  echo "== warm-up: nano shape, 32 prompts =="; $B $Q --num-prompts 32 --input-len 300 --output-len 64 --max-model-len 2048 --kv-cache-dtype fp8 2>&1 | show
  echo "== nano: fp8 KV =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8.json 2>&1 | show
  echo "== nano: fp8 KV, again =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_2.json 2>&1 | show
  echo "== latency qwen =="; $B $Q $LAT --output-json $J/qwen_lat.json 2>&1 | show
  echo "== latency llama: warm-up =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency llama =="; $B $L $LAT --output-json $J/llama_lat.json 2>&1 | show
  LL="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
  echo "== Llama-3.1-8B 512 x 1000/1000: fp8 KV =="; $B $L $LL --kv-cache-dtype fp8 --output-json $J/llama_fp8.json 2>&1 | show
  ;;
blocks)
  LL="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384 --kv-cache-dtype fp8"
  echo "== Llama-8B fp8, block 128 =="; $B $L $LL --output-json $J/llama_fp8_b128_1.json 2>&1 | show
  echo "== Llama-8B fp8, block 16 =="; $B $L $LL --block-size 16 --output-json $J/llama_fp8_b16.json 2>&1 | show
  echo "== Llama-8B fp8, block 128, again =="; $B $L $LL --output-json $J/llama_fp8_b128_2.json 2>&1 | show
  ;;
last)
  python3 -m pytest -m gpu -q -s -x tests/kernels/test_fused_ops.py tests/kernels/test_attention_kernels.py tests/models/test_cuda_vs_hf.py tests/runner 2>&1 | grep -E "agreement|agrees|graph vs|passed|failed|Error" | tail -10
  for i in 1 2 3; do echo "== nano: fp8 KV, run $i =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_$i.json 2>&1 | show; done
  echo "== latency qwen =="; $B $Q $LAT --output-json $J/qwen_lat.json 2>&1 | show
  echo "== latency llama: warm-up =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency llama =="; $B $L $LAT --output-json $J/llama_lat.json 2>&1 | show
  ;;
esac
