#!/bin/bash
# Device run: sweep the decode kernel's (BLOCK_N, warps, stages) over an fp8 cache, then run
# the nano-vllm protocol and the Llama-8B workload with fp8 KV at the default config and at
# the sweep's best (EMBER_DECODE_CONFIG), back to back in one call. Logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0 --kv-cache-dtype fp8"
NANO="--num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384"
LL="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
show() { grep -E "^==|Throughput|preempt"; }
python3 benchmarks/scripts/decode_sweep.py fp8 2>&1 | grep -v Error | tee $OUT/sweep_fp8.log
BEST=$(grep BEST_QWEN $OUT/sweep_fp8.log | cut -d= -f2)
echo "== nano fp8, default config =="; $B benchmarks/configs/qwen3-0.6b $NANO 2>&1 | show
echo "== nano fp8, config $BEST =="; EMBER_DECODE_CONFIG=$BEST $B benchmarks/configs/qwen3-0.6b $NANO 2>&1 | show
echo "== Llama-8B fp8, config $BEST =="; EMBER_DECODE_CONFIG=$BEST $B benchmarks/configs/llama-3.1-8b $LL 2>&1 | show
