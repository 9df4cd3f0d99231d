#!/bin/bash
# Device runs of session 6 (issue #7: one request at Llama-8B, 217 -> 250 tok/s), from the repo
# root; logs and JSON gathered into $OUT/s6.tgz (the device tool brings back at most 8 files).
#   probe: l2_prefetch_probe.py (the 8B step's matmul chain with stand-ins for the small kernels,
#          with and without L2 prefetch of the next weight), one request at Llama-8B with each
#          EMBER_L2_PREFETCH plan, the step profile with one plan, skinny_gemm_probe.py --modes
#          (mode 3: the prologue on the one real row). The EMBER_L2_PREFETCH hooks it ran are
#          at commit 8e507ec; they lost and were removed after.
#   chain: pdl_chain_probe.py (every kernel of the 8B matmul chain, stand-ins included, launched
#          with PDL; matmuls in one wave, their first weight tiles loaded before the wait)
#   merge, merge2: ran the fused merge of commit 051f9d1 (reverted after).
#   merge: (decode attention merges its splits in the split kernel: no merge kernel) every GPU test
#          (kernels, runner, HF comparison), one request at both shapes, the 8B and 0.6B step
#          profiles, 8 requests at both shapes, nano-vllm x2 (fp8 KV)
#   merge2: (the merging program reads only the splits that hold context) the attention GPU
#          tests, one request at both shapes, both step profiles
#   warm:  l2_warm_probe.py (warming the next weight in L2 on a side stream of the graph)
#   persist: persistent_chain_probe.py (the 8B step's 128 matmuls in one launch, grid barriers
#          between them, each program loading its next weight tile before it waits)
#   final: at the final commit (the engine as session 5 left it): every GPU test, one request at
#          both shapes, the 8B one with --profile-steps (the CPU's share of a step); then the
#          probes once more, after they moved their shared parts into step_chain.py
source benchmarks/scripts/h200_env.sh
J=/tmp/s6; mkdir -p $J
pack() { tar czf $OUT/s6.tgz -C $J .; }
all_gpu_tests() {
  python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels tests/models/test_cuda_vs_hf.py tests/runner 2>&1 \
    | grep -E "agreement|agrees|graph vs|passed|failed|Error|^E |FAILED|\.py:[0-9]+" | tail -30 | tee $J/gpu_tests.log
}
one_request_both() {  # one request 128/512 at both shapes (the 8B after a short warm-up run)
  echo "== latency qwen =="; $B $Q $LAT --output-json $J/qwen_lat.json 2>&1 | show
  echo "== latency llama: warm-up =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  echo "== latency llama =="; $B $L $LAT --output-json $J/llama_lat.json 2>&1 | show
}
case "$1" in
probe)
  (cd benchmarks/scripts && timeout 120 python3 l2_prefetch_probe.py) 2>&1 | tee $J/l2_probe.log
  echo "== latency llama: warm-up =="; $B $L --num-prompts 1 --input-len 128 --output-len 64 2>&1 | show
  n=0
  for plan in "" "o=1" "o=1,qkv=0.25" "o=1,qkv=0.25,gate_up=0.05,down=0.1" "o=0.5"; do
    n=$((n + 1))
    echo "== latency llama: EMBER_L2_PREFETCH='$plan' =="
    EMBER_L2_PREFETCH=$plan timeout 90 $B $L $LAT --output-json $J/llama_lat_$n.json 2>&1 | show
  done
  EMBER_L2_PREFETCH="o=1" timeout 90 $P $L --skip 60 --steps 60 2>&1 | grep -A30 "^==" | tee $J/profile_llama_o1.log
  pack
  (cd benchmarks/scripts && timeout 100 python3 skinny_gemm_probe.py --modes) 2>&1 | tee $J/skinny_modes.log
  pack
  ;;
chain)
  (cd benchmarks/scripts && timeout 400 python3 pdl_chain_probe.py) 2>&1 | tee $J/pdl_chain.log
  pack
  ;;
merge)
  all_gpu_tests
  one_request_both
  $P $L --skip 60 --steps 60 2>&1 | grep -A30 "^==" | tee $J/profile_llama_1.log
  $P $Q --skip 60 --steps 60 2>&1 | grep -A30 "^==" | tee $J/profile_qwen_1.log
  B8="--num-prompts 8 --input-len 128 --output-len 512 --max-model-len 2048"
  for m in Q L; do echo "== 8 requests $m =="; $B ${!m} $B8 --output-json $J/b8_$m.json 2>&1 | show; done
  for i in 1 2; do echo "== nano: fp8 KV, run $i =="; $B $Q $NANO --kv-cache-dtype fp8 --output-json $J/nano_fp8_$i.json 2>&1 | show; done
  pack
  ;;
merge2)
  python3 -m pytest -m gpu -q -rf --tb=short tests/kernels/test_attention_kernels.py tests/runner 2>&1 | tail -3 | tee $J/gpu_tests.log
  one_request_both
  $P $L --skip 60 --steps 60 2>&1 | grep -A12 "^==" | tee $J/profile_llama_1.log
  $P $Q --skip 60 --steps 60 2>&1 | grep -A12 "^==" | tee $J/profile_qwen_1.log
  pack
  ;;
warm)
  (cd benchmarks/scripts && timeout 300 python3 l2_warm_probe.py) 2>&1 | tee $J/l2_warm.log
  pack
  ;;
persist)
  (cd benchmarks/scripts && timeout 240 python3 persistent_chain_probe.py) 2>&1 | tee $J/persistent_chain.log
  pack
  ;;
final)
  all_gpu_tests
  one_request_both
  echo "== latency llama, --profile-steps =="; $B $L $LAT --profile-steps 2>&1 | grep -E "^==|Throughput|Per step|schedule|prepare|launch|wait|update" | head -20 | tee $J/llama_lat_steps.log
  pack
  (cd benchmarks/scripts && for p in pdl_probe pdl_chain_probe l2_warm_probe persistent_chain_probe; do
     echo "== $p =="; timeout 150 python3 $p.py; done) 2>&1 | tee $J/probes_again.log
  pack
  ;;
esac
