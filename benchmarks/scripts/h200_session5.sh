#!/bin/bash
# Device runs of session 5 (issue #7), from the repo root; logs and JSON under $OUT.
#   first: GPU test of the sampling kernel (four uniforms a Philox call, base-2 logs), nano x3
#          (the first shows whether a call's first engine is still slow), step profiles at
#          batch 256 and 32 (the run's tail), the skinny-GEMM probe, one request at both shapes
#   sweep: GPU tests of what changed (sampling: approximate log2 with a series near 1; RoPE
#          loads up front), the Gumbel kernel timed with either log2, the fp8 decode-attention
#          sweep at 128-token pages (nano shape, 1 or 2 splits), nano x2 at the default config
#          and x2 at the sweep's best
#   check: (fp8 decode config now 64,2,5) the GPU tests with failures shown, the Gumbel kernel
#          timed again (one row, either order), the fp8 sweep at the Llama-8B shape
#   final: the sampling tests, then every benchmark of #7 in one call: nano-vllm x2, Llama-8B
#          512 x 1000/1000, HF's static batch against ember on the same prompts, one request at
#          both shapes; then the bfloat16 decode sweep at 128-token pages for one request
#   watch: why a call's first nano run is sometimes slower: nano x4 under compile_watch.py (the
#          Triton kernel variants built inside the timed run), the 2nd and 4th with --profile-steps
#   dot:   the tensor-core GEMV path for 1-16 rows (norm fused): GPU tests, one request at both
#          shapes, the 8B step profile, 8 requests at both shapes with the path on and off
#          (EMBER_SMALL_BATCH_GEMV=0: cuBLAS), nano x2
#   last:  GPU tests of the kernels changed this session (sampling, RoPE, attention) at the final
#          commit; the bfloat16 decode sweep at 128-token pages (nano and Llama shapes), then nano
#          with a bfloat16 cache at the default config and at the sweep's best
#   modes: skinny_gemm_probe.py --modes (why the fused tensor-core GEMV lost in the engine)
#   pdl:   pdl_probe.py (one request at Llama-8B: the matmul chain with and without programmatic
#          dependent launch)
source benchmarks/scripts/h200_env.sh
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
sweep)
  python3 -m pytest -m gpu -q -x tests/kernels/test_sampling_kernel.py tests/kernels/test_fused_ops.py 2>&1 | tail -2
  python3 - <<'PY' 2>&1 | tee $J/gumbel_time.log
import torch
from triton.testing import do_bench
from ember.kernels.sampling import gumbel_argmax
for rows in (256, 32, 1):
    x = torch.randn(rows, 151936, device="cuda").bfloat16()
    for fast in (False, True):
        us = do_bench(lambda: gumbel_argmax(x, 1.0, seed=1, fast_log=fast), warmup=10, rep=50) * 1e3
        print(f"gumbel rows {rows:3d} fast_log {fast!s:5}: {us:7.1f} us")
PY
  python3 benchmarks/scripts/decode_sweep.py fp8 --page 128 --only "qwen3-0.6b bs256" --splits 1,2 2>&1 | grep -v Error | tee $J/sweep_fp8_page128.log
  BEST=$(grep BEST_QWEN $J/sweep_fp8_page128.log | cut -d= -f2)
  for i in 1 2; do
    echo "== nano: fp8 KV, default decode config, run $i =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_default_$i.json 2>&1 | show
    echo "== nano: fp8 KV, decode config $BEST, run $i =="; EMBER_DECODE_CONFIG=$BEST $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_best_$i.json 2>&1 | show
  done
  ;;
check)
  python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels tests/models/test_cuda_vs_hf.py tests/runner 2>&1 | grep -E "agreement|agrees|graph vs|passed|failed|Error|^E |FAILED|\.py:[0-9]+" | tail -40
  python3 - <<'PY' 2>&1 | tee $J/gumbel_time.log
import torch
from triton.testing import do_bench
from ember.kernels.sampling import gumbel_argmax
for rows in (1, 256, 1):
    x = torch.randn(rows, 151936, device="cuda").bfloat16()
    for fast in (True, False, True):
        us = do_bench(lambda: gumbel_argmax(x, 1.0, seed=1, fast_log=fast), warmup=20, rep=100) * 1e3
        print(f"gumbel rows {rows:3d} fast_log {fast!s:5}: {us:7.1f} us")
PY
  python3 benchmarks/scripts/decode_sweep.py fp8 --page 128 --only "llama-8b" 2>&1 | grep -v Error | tee $J/sweep_fp8_page128_llama.log
  ;;
final)
  python3 -m pytest -m gpu -q tests/kernels/test_sampling_kernel.py 2>&1 | tail -1
  for i in 1 2; do echo "== nano: fp8 KV, run $i =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_$i.json 2>&1 | show; done
  LL="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
  echo "== Llama-3.1-8B 512 x 1000/1000: fp8 KV =="; $B $L $LL --kv-cache-dtype fp8 --output-json $J/llama_fp8.json 2>&1 | show
  echo "== HF static batch 256 x 512/256 (ember fp8 on the same prompts first) =="
  $B $Q --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 1024 --max-num-seqs 256 \
    --max-num-batched-tokens 16384 --kv-cache-dtype fp8 --compare hf --hf-batch-size 256 --output-json $J/hf.json 2>&1 | show
  echo "== latency qwen =="; $B $Q $LAT --output-json $J/qwen_lat.json 2>&1 | show
  echo "== latency llama: warm-up =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency llama =="; $B $L $LAT --output-json $J/llama_lat.json 2>&1 | show
  python3 benchmarks/scripts/decode_sweep.py --page 128 --only "qwen3-0.6b bs1" --splits 8,16 2>&1 | grep -v Error | tee $J/sweep_bf16_page128_bs1.log
  ;;
watch)
  W="python3 benchmarks/scripts/compile_watch.py bench throughput --load-format dummy --seed 0"
  for i in 1 2 3 4; do
    extra=""; [ $((i % 2)) = 0 ] && extra="--profile-steps"
    echo "== nano: fp8 KV, run $i $extra =="
    $W $Q $NANO --kv-cache-dtype fp8 $extra --output-json $J/nano_watch_$i.json 2>&1 | grep -E "^==|Throughput|Start-up|Per step|IN RUN" | head -40
  done
  ;;
pdl)
  python3 benchmarks/scripts/pdl_probe.py 2>&1 | tee $J/pdl_probe.log
  ;;
dot)
  python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_gemv.py tests/kernels/test_sampling_kernel.py tests/models/test_cuda_vs_hf.py tests/runner 2>&1 | grep -E "agreement|agrees|graph vs|passed|failed|Error|^E |FAILED" | tail -20
  echo "== latency qwen =="; $B $Q $LAT --output-json $J/qwen_lat.json 2>&1 | show
  echo "== latency llama: warm-up =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency llama =="; $B $L $LAT --output-json $J/llama_lat.json 2>&1 | show
  $P $L --skip 60 --steps 60 2>&1 | grep -A30 "^==" | tee $J/profile_llama_1.log
  B8="--num-prompts 8 --input-len 128 --output-len 512 --max-model-len 2048"
  for m in Q L; do
    echo "== 8 requests $m: dot path =="; $B ${!m} $B8 --output-json $J/b8_${m}_dot.json 2>&1 | show
    echo "== 8 requests $m: cuBLAS =="; EMBER_SMALL_BATCH_GEMV=0 $B ${!m} $B8 --output-json $J/b8_${m}_cublas.json 2>&1 | show
  done
  for i in 1 2; do echo "== nano: fp8 KV, run $i =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_$i.json 2>&1 | show; done
  ;;
last)
  python3 -m pytest -m gpu -q -rf --tb=short tests/kernels/test_sampling_kernel.py tests/kernels/test_fused_ops.py tests/kernels/test_attention_kernels.py 2>&1 | grep -E "passed|failed|^E |FAILED" | tail -8
  python3 benchmarks/scripts/decode_sweep.py --page 128 --only "qwen3-0.6b bs256" 2>&1 | grep -v Error | tee $J/sweep_bf16_page128_qwen.log
  python3 benchmarks/scripts/decode_sweep.py --page 128 --only "llama-8b" 2>&1 | grep -v Error | tee $J/sweep_bf16_page128_llama.log
  BEST=$(grep BEST_QWEN $J/sweep_bf16_page128_qwen.log | cut -d= -f2)
  echo "== nano: bf16 KV, default config =="; $B $Q $NANO --output-json $J/nano_bf16_default.json 2>&1 | show
  echo "== nano: bf16 KV, config $BEST =="; EMBER_DECODE_CONFIG=$BEST $B $Q $NANO --output-json $J/nano_bf16_best.json 2>&1 | show
  ;;
modes)
  (cd benchmarks/scripts && python3 skinny_gemm_probe.py --modes) 2>&1 | tee $J/skinny_modes.log
  ;;
esac
