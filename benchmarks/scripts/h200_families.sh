#!/bin/bash
# Device run for the model families (from the repo root): `tests` runs the GPU tests of the
# attention kernels (windows, soft-caps), the families against HF and the CUDA graphs, then
# the dense Llama-3.1-8B shape 512 x 1000/1000 (the window must cost it nothing);
# `families` runs Gemma-2-9B and Phi-4 (14B) shapes, 512 x 1000/1000. JSON under $OUT/json.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; J=$OUT/json; mkdir -p $J
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
RUN="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
case "${1:-tests}" in
  tests)
    python3 -m pytest -m gpu -q -s tests/kernels tests/models/test_cuda_families.py tests/models/test_cuda_vs_hf.py \
      tests/runner/test_cuda_graph.py 2>&1 | grep -E "agreement|agrees|mean \|diff|passed|failed|Error|FAIL"
    echo "== Llama-3.1-8B shape 512 x 1000/1000 =="
    $B benchmarks/configs/llama-3.1-8b $RUN --output-json $J/llama.json 2>&1 | grep -v "^\s*$" ;;
  families)
    python3 -m pytest -m gpu -q -s tests/kernels/test_fused_ops.py tests/models/test_cuda_families.py -k "gemma or gelu" \
      2>&1 | grep -E "agreement|agrees|passed|failed|Error|FAIL"
    for m in gemma-2-9b phi-4; do
      echo "== $m shape 512 x 1000/1000 =="
      $B benchmarks/configs/$m $RUN --output-json $J/$m.json 2>&1 | grep -v "^\s*$"
    done ;;
esac
