#!/bin/bash
# Device runs for mixtures of experts (Qwen3-30B-A3B and Mixtral-8x7B shapes, dummy bf16
# weights, bf16 KV), from the repo root; logs and JSON under $OUT.
#   check:        the GPU tests of the fused MoE kernels and of the MoE families against HF
#                 (CUDA graphs included), then moe_tune.py (writes $OUT/moe_configs.json, to
#                 commit as ember/kernels/moe_configs.json), then one request at each shape
#   race SHAPE:   vLLM 0.24 (vllm_race.py, staged: /work/shared/peers/vllm-gpu/stage, its last
#                 part .vllm-s5 carried in this call) and ember on the same requests in this
#                 call: 512 x 1000/1000 and one request 128/512; then where ember's decode step
#                 goes (profile_gpu_steps.py at batch 1 and 512). SHAPE: qwen3-30b-a3b | mixtral-8x7b
source benchmarks/scripts/h200_env.sh
TP="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "$1" in
check)
  timeout 300 python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_moe_kernels.py \
    tests/models/test_cuda_families.py -k "moe or mixtral" 2>&1 \
    | grep -E "agreement|agrees|passed|failed|Error|^E |FAILED|\.py:[0-9]+" | tail -40 | tee $J/gpu_tests.log
  timeout 280 python3 benchmarks/scripts/moe_tune.py 2>&1 | grep -E "TUNED|wrote|Error" | tee $J/moe_tune.log
  cp ember/kernels/moe_configs.json $J/ 2>/dev/null
  for s in qwen3-30b-a3b mixtral-8x7b; do
    echo "== $s one request 128/512 (tuned) ==" | tee -a $J/ember_check.log
    timeout 90 $B benchmarks/configs/$s $LAT 2>&1 | show | tee -a $J/ember_check.log
  done
  ;;
race)
  C=benchmarks/configs/$2
  [ -d "$C" ] || { echo "no shape $2 under benchmarks/configs"; exit 2; }
  if [ -x .vllm-s5/run-on-device ]; then
    .vllm-s5/run-on-device none >/dev/null  # installs vLLM into /tmp/vllm-site; runs no workload
    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/vllm-site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
      timeout ${VLLM_TIMEOUT:-300} python3 benchmarks/scripts/vllm_race.py --config $2 throughput latency 2>&1 \
      | grep -E "^RESULT|Error|error:" | tee $J/vllm_$2.log
  else
    echo "vLLM is not staged (.vllm-s5): ember only"
  fi
  echo "== $2 512 x 1000/1000 ==" | tee -a $J/ember_$2.log
  timeout 200 $B $C $TP --output-json $J/ember_$2.json 2>&1 | show | tee -a $J/ember_$2.log
  echo "== $2 one request 128/512 ==" | tee -a $J/ember_$2.log
  timeout 60 $B $C $LAT --output-json $J/ember_$2_latency.json 2>&1 | show | tee -a $J/ember_$2.log
  timeout 90 $P $C --num-prompts 1 --input-len 128 --output-len 160 --skip 40 --steps 60 2>&1 | tail -30 \
    > $J/profile_$2_1.log
  timeout 120 $P $C --num-prompts 512 --input-len 1000 --output-len 80 --skip 45 --steps 20 --top 20 2>&1 \
    | tail -28 > $J/profile_$2_512.log
  ;;
*)
  echo "usage: $0 check | race SHAPE"; exit 2
  ;;
esac
