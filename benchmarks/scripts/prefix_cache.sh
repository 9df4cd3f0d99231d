#!/usr/bin/env bash
# Issue #5's benchmark: the prefix cache on and off.
# 1. ember serve + `bench serve --dataset shared-prefix` (conversations on one ~2k-token
#    system prompt, 5 turns each, each turn carrying the history): TTFT and throughput.
# 2. `bench throughput` on the random dataset (nothing to hit), on and off, alternating,
#    for the cost of the cache's bookkeeping.
set -u
cd "$(dirname "$0")/../.."
M=$(.venv/bin/python -m ember.loader.default_model)
OUT=${OUT:-/tmp/prefix_bench}; mkdir -p $OUT
DT=${DTYPE:-bfloat16}
ARGS="--dataset shared-prefix --num-prompts 4 --num-turns 5 --shared-prefix-len 2048 --turn-input-len 32 \
      --random-output-len 64 --ignore-eos --seed 0"
for CACHE in enable no-enable; do
  .venv/bin/ember serve $M --dtype $DT --port 8083 --uvicorn-log-level warning --$CACHE-prefix-caching \
      > $OUT/serve-$CACHE.log 2>&1 &
  EP=$!
  for i in $(seq 180); do curl -sf http://127.0.0.1:8083/health >/dev/null && break; sleep 1; done
  .venv/bin/ember bench serve --base-url http://127.0.0.1:8083 --label "ember $DT --$CACHE-prefix-caching" $ARGS \
      --output-json $OUT/shared-prefix-$CACHE.json
  kill -TERM $EP; wait $EP
done
for ROUND in 1 2 3; do
  for CACHE in enable no-enable; do
    .venv/bin/ember bench throughput --dtype $DT --num-prompts 16 --input-len 64 --output-len 128 \
        --$CACHE-prefix-caching --output-json $OUT/random-$CACHE-$ROUND.json 2>&1 | grep -i "tok/s"
  done
done
