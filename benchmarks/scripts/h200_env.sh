# Shared by the h200_*.sh device scripts (sourced from the repo root): paths, the
# bench command, the nano-vllm and one-request workloads, and a filter for the bench's output.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; J=$OUT; mkdir -p $J
Q=benchmarks/configs/qwen3-0.6b; L=benchmarks/configs/llama-3.1-8b
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
NANO="--num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384"
LAT="--num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048"
show() { grep -E "^==|Throughput|Start-up|Roofline|Per step|KV|preempt|ember/hf" | grep -v "^\s*$"; }
P="python3 benchmarks/scripts/profile_gpu_steps.py"
