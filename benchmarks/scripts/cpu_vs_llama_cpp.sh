#!/usr/bin/env bash
# ember against llama.cpp on the CPU, same GGUF, same 2 threads, one after the other, for each
# file given (default: the default model, and its Q4_K_M made by llama.cpp's llama-quantize
# where tests/models/llama_cpp_reference.py made it):
#   llama-bench pp512 / tg128  vs  ember bench throughput: a 512-token prefill, one request 128/128
#   16 concurrent, 68 in / 128 out, the same `ember bench serve` client: llama-server vs ember serve (its
#   core in its own process, then --no-core-process), and ember offline on the same 16 requests' shape
# Prints the CPU's model and flags first (results differ between CPUs: record them).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cpu_vs_llama_cpp}; mkdir -p $OUT
DEFAULT=$(.venv/bin/python -m ember.loader.default_model)
FILES=${*:-"$DEFAULT ${DEFAULT%.Q4_1.gguf}.Q4_K_M.gguf"}
lscpu | grep -E "Model name|^Flags" | sed 's/^Flags: */flags: /' | tee $OUT/cpu.txt | cut -c1-200
SERVE="--num-prompts 16 --random-input-len 68 --random-output-len 128 --max-concurrency 16 --ignore-eos --seed 0"
for M in $FILES; do
  [ -f "$M" ] || { echo "skip $M (not here)"; continue; }
  name=$(basename $M .gguf)
  echo "== $name"
  ../shared/peers/llama-cpp bench -m $M -t 2 -p 512 -n 128 -r 3 2>&1 | grep -E "pp512|tg128"
  .venv/bin/ember bench throughput $M --num-prompts 1 --input-len 512 --output-len 1 --no-enable-prefix-caching \
    --output-json $OUT/$name-prefill.json | grep Throughput | sed 's/^/ember 512-token prefill: /'
  .venv/bin/ember bench throughput $M --num-prompts 1 --input-len 128 --output-len 128 --no-enable-prefix-caching \
    --output-json $OUT/$name-1x128.json | grep Throughput | sed 's/^/ember 1 x 128\/128: /'
  ../shared/peers/llama-cpp server -m $M --host 127.0.0.1 --port 8081 -t 2 -tb 2 -np 16 -c 8192 --cont-batching \
    --cache-ram 0 > $OUT/llama-server.log 2>&1 &
  LP=$!
  for i in $(seq 120); do curl -sf http://127.0.0.1:8081/health >/dev/null && break; sleep 1; done
  .venv/bin/ember bench serve --base-url http://127.0.0.1:8081 --label llama-server $SERVE \
    --extra-body '{"cache_prompt": false}' --output-json $OUT/$name-llama-server.json | grep -E "Output token|Mean TTFT" \
    | sed 's/^/llama-server: /'
  kill $LP; wait $LP 2>/dev/null
  for mode in core-process no-core-process; do  # the engine core in its own process (the default), then not
    flag=""; [ $mode = no-core-process ] && flag=--no-core-process
    .venv/bin/ember serve $M --port 8082 --uvicorn-log-level warning $flag > $OUT/ember-$mode.log 2>&1 &
    EP=$!
    for i in $(seq 180); do curl -sf http://127.0.0.1:8082/health >/dev/null && break; sleep 1; done
    .venv/bin/ember bench serve --base-url http://127.0.0.1:8082 --label ember $SERVE \
      --output-json $OUT/$name-ember-$mode.json | grep -E "Output token|Mean TTFT" | sed "s/^/ember serve ($mode): /"
    kill -TERM $EP; wait $EP
  done
  # what serving keeps of the engine: the same 16 x 68/128 offline
  .venv/bin/ember bench throughput $M --num-prompts 16 --input-len 68 --output-len 128 --no-enable-prefix-caching \
    --output-json $OUT/$name-16x68-128.json | grep Throughput | sed 's/^/ember offline 16 x 68\/128: /'
done
