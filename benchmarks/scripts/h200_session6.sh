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
source benchmarks/scripts/h200_env.sh
J=/tmp/s6; mkdir -p $J
pack() { tar czf $OUT/s6.tgz -C $J .; }
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
esac
