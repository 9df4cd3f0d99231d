#!/usr/bin/env bash
# ember serve vs llama.cpp's llama-server, same client, one after the other (issue #4's goal).
set -u
cd "$(dirname "$0")/../.."
M=$(.venv/bin/python -m ember.loader.default_model)
OUT=${OUT:-/tmp/serve_bench}; mkdir -p $OUT
ARGS="--num-prompts 16 --random-input-len 68 --random-output-len 128 --max-concurrency 16 --ignore-eos --seed 0"
../shared/peers/llama-cpp server -m $M --host 127.0.0.1 --port 8081 -t 2 -tb 2 -np 16 -c 8192 --cont-batching --cache-ram 0 > $OUT/llama.log 2>&1 &
LP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8081/health >/dev/null && break; sleep 1; done
.venv/bin/ember bench serve --base-url http://127.0.0.1:8081 --model smollm2 --label llama-server $ARGS --extra-body '{"cache_prompt": false}' --output-json $OUT/llama.json
kill $LP; wait $LP 2>/dev/null
for DT in float32 bfloat16; do
  .venv/bin/ember serve $M --dtype $DT --port 8082 --uvicorn-log-level warning > $OUT/ember-$DT.log 2>&1 &
  EP=$!
  for i in $(seq 180); do curl -sf http://127.0.0.1:8082/health >/dev/null && break; sleep 1; done
  .venv/bin/ember bench serve --base-url http://127.0.0.1:8082 --label "ember $DT" $ARGS --output-json $OUT/ember-$DT.json
  kill -TERM $EP; wait $EP
done
