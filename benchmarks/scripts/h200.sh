#!/bin/bash
# The H200 runs of BENCHMARKS.md, one mode a device call (each fits the 10-minute limit of a
# call), run from the repo root on the device. Logs and JSON land under $OUT (the device tool's
# folder; /tmp/out elsewhere); the filtered lines go to stdout.
#
#   benchmarks/scripts/h200.sh MODE [ARGS]
#
#   env                 the GPU, its clocks, and the torch / triton / transformers versions
#   smoke               the GPU kernel tests (stop at the first failure) and one small profiled engine run
#   tests               the GPU tests: kernels, the families and dense models against HF, CUDA graphs
#                       against eager, the runner
#   race-nano [KV]      nano-vllm protocol at the Qwen3-0.6B shape (256 requests, in/out U[100, 1024]):
#                       vLLM (its peer bench.py, `qwen`), then ember plain and with --profile-steps;
#                       KV = auto | fp8, ember's --kv-cache-dtype (default auto)
#   race-llama [KV]     Llama-3.1-8B shape, 512 x 1000/1000 and one request 128/512: vLLM (vllm_race.py
#                       --kv-cache-dtype KV), then ember (the one request also with --profile-steps)
#   race-latency        one request 128/512 at the Qwen3-0.6B shape: vLLM (vllm_race.py), then ember
#   hf                  ember and HF transformers `generate` on the same 256 x 512/256 prompts (the ratio)
#   all                 tests, nano, hf, one request at both shapes, Llama-8B 512 x 1000/1000: ember only
#   race-fp8            FP8 weights and an fp8 KV cache at the Llama-3.1-8B shape: vLLM (vllm_race.py
#                       --weights fp8 --kv-cache-dtype fp8), then ember with fp8 and with bf16 weights
#   check-fp8           the GPU tests of the FP8 kernels, the GEMV and the engine with FP8 weights
#   check-int           the GPU tests of the W4A16 / W8A16 kernels, the GEMV and the engine with AWQ, GPTQ and
#                       compressed-tensors checkpoints
#   check-int-moe       the GPU tests of integer experts (W4A16 / W8A16) in the fused MoE kernels (Mixtral-8x7B's
#                       and Qwen3-30B-A3B's shapes, in CUDA graphs) and of the engine with AWQ / GPTQ Mixtral and
#                       Qwen3-MoE checkpoints, then moe_tune.py --int 4 at both shapes (--no-write: each choice
#                       against the heuristic)
#   int4-kernels        the W4A16 kernels' GPU tests, int4_gemv_bench.py --sweep --write (the word GEMV and the
#                       matmul against cuBLAS bf16 at the Llama-3.1-8B shapes; its TUNED dicts written into
#                       int_gemv.py / wna16.py, both copied to $OUT), then ember AWQ and bf16 one request 128/512
#                       on those tiles and where AWQ's decode step goes (no vLLM: race-int races it)
#   gguf-kernels        the GGUF kernels' GPU tests, gguf_gemv_bench.py --sweep --write (the word GEMV against the
#                       per-value one and cuBLAS bf16 at the Llama-3.1-8B shapes, Q4_K / Q6_K / Q4_1, 1 / 2 / 4 rows;
#                       its TUNED dict written into kernels/gguf_gemv.py, copied to $OUT) (needs the gguf wheel
#                       carried, as gguf-cuda)
#   race-int [awq|gptq] W4A16 at the Llama-3.1-8B shape with dummy weights under an AWQ (default) or GPTQ
#                       config (benchmarks/configs/llama-3.1-8b-awq / -gptq): vLLM (its AWQ-Marlin / GPTQ-Marlin,
#                       vllm_race.py: one request, 512 x 1000/1000), then ember on both, then ember's bf16 one request
#   gguf-cuda           GGUF blocks kept on CUDA (kernels/gguf.py): their GPU tests (every type at the Llama-8B shapes,
#                       in CUDA graphs; the engine on a Q4_K_M file and, where cached, the default model against the
#                       CPU's tokens), then a Q4_K_M file at the Llama-3.1-8B shape (random blocks in llama.cpp's type
#                       mix, ember/bench/dummy_gguf.py, 4.6 GiB, written here) one request 128/512, and ember's bf16
#                       at the same shape (needs the gguf wheel carried, as serve's: SERVE_WHEELS, default .whl), then
#                       the GEMV's time a layer at the 8B shapes against cuBLAS in bf16 (gguf_gemv_bench.py)
#   w8a8 [PART]         W8A8 (compressed-tensors int-quantized) at the Llama-3.1-8B shape with dummy weights under
#                       llm-compressor's W8A8 config (benchmarks/configs/llama-3.1-8b-w8a8). PART check (default):
#                       the GPU tests of the int8 kernels and of the engine on W8A8 checkpoints, int8_gemm_bench.py
#                       (with --sweep when PART is sweep), then ember 512 x 1000/1000; PART race: vLLM first
#                       (vllm_race.py --config llama-3.1-8b-w8a8; its W8A8 path imports compressed-tensors: stage
#                       its wheels with vLLM's), then ember 512 x 1000/1000 and the bf16 shape's, in the time left
#   kernels-fp8         fp8_gemm_bench.py --sweep at the Llama-8B shapes, M = 1 .. 2048 (its last line
#                       says what FP8_GEMV_MAX_ROWS in ember/layers/kernel_paths.py should be)
#   check-moe           the GPU tests of the MoE kernels and families, moe_tune.py (writes
#                       ember/kernels/moe_configs.json, copied to $OUT), one request at each MoE shape
#   race-moe SHAPE      vLLM (vllm_race.py --config SHAPE), then ember: 512 x 1000/1000, its prefills alone
#                       (512 x 1000/1), one request 128/512, and where the decode step goes at batch 1 and 512
#                       (profile_gpu_steps.py); SHAPE: qwen3-30b-a3b | mixtral-8x7b | deepseek-v2-lite |
#                       qwen3-next-30b-a3b (Qwen3-Next's layers at Qwen3-30B-A3B's experts: ~58 GB of weights and
#                       ~76 MB of linear-attention state a seat, so an H200)
#   race-gpt-oss        vLLM (vllm_race.py --config gpt-oss-120b latency throughput256), then ember: the gpt-oss-120b
#                       shape with dummy MXFP4 experts, one request 128/512 and 256 x 1000/1000 at vLLM's limits
#                       (512 seats, 16,384 tokens a step, max_model_len 2048); vLLM takes ~190 s to start and ~140 s
#                       for the 256 on an H100, so ember's part gets what is left of the call (VLLM_TIMEOUT, default 420)
#   families            the GPU tests of the Gemma / GeGLU paths, then the Gemma-2-9B and Phi-4 shapes at
#                       512 x 1000/1000 (no peer)
#   new-families        the GPU tests of the families from issue #36 (GPT-2, OPT, Phi-2 at a non-power-of-two
#                       head, DeepSeek's latent attention at its real latent sizes) and of the attention kernels
#                       at any head_dim, then the DeepSeek-V2-Lite shape: one request 128/512 and 256 x 1000/1000
#                       (ember alone)
#   mla-decode          the GPU tests of the MLA decode kernel (DeepSeek-V2-Lite's and V3's shapes) and of
#                       DeepSeek's families, then mla_decode_bench.py (the MLA kernel against the generic one)
#                       at V2-Lite's shape over bf16 (with --sweep: its other tiles) and fp8, and at V3's 128
#                       heads; new-families runs the DeepSeek-V2-Lite engine shape (now on the MLA kernel)
#   gpt-oss             the GPU tests of gpt-oss's fused experts (biases, the clamped SwiGLU, MXFP4 decoded in
#                       the kernels at gpt-oss-120b's expert shapes, in CUDA graphs) and of the gpt-oss families
#                       against HF (dense and MXFP4 experts), then the gpt-oss-120b shape with dummy MXFP4
#                       experts (60.9 GB; one GPU): one request 128/512 and 256 x 1000/1000 (ember alone)
#   moe-speed [PART]    PART kernels (default): the MoE kernels' GPU tests (the decode GEMV in graphs at real
#                       shapes), moe_tune.py at decode and prefill token counts for gpt-oss-120b (MXFP4) and
#                       DeepSeek-V2-Lite (moe_configs.json to $OUT), gpt-oss's CUDA family cases; PART engines:
#                       gpt-oss-120b one request 128/512 and where its decode step goes (profile_gpu_steps.py),
#                       DeepSeek-V2-Lite 512 x 1000/1000 plain and with --profile-steps, and its decode step at
#                       512 seats (profile_gpu_steps.py: kernels and the host's ops) (ember alone: race vLLM on
#                       the same warm machine with vllm_race.py)
#   sweep-decode [fp8]  decode_sweep.py over a bf16 (default) or fp8 cache, then the nano protocol at the
#                       default config and at the sweep's best (EMBER_DECODE_CONFIG), and Llama-8B at the best
#   defaults            ember at its defaults (no seat or budget flag) and at other flags, in one call: the
#                       nano protocol (defaults, 256 / 16384, 1024 / 16384) and Llama-8B 512 x 1000/1000
#                       (defaults, 384 / 16384, 448 / 16384, 512 / 16384; the defaults again with the rank in
#                       a worker process, --distributed-executor-backend mp); then the defaults' GPU tests
#   tp-check            on nvidia-h200-x2 (two GPUs), NVLink multicast off: the two-GPU tests
#                       (tests/distributed/test_peer_all_reduce_gpu.py, test_tensor_parallel_gpu.py), one
#                       all-reduce's time, NCCL against the peer all-reduce (all_reduce_bench.py), then ember
#                       at the Llama-3.1-8B shape, one request 128/512 at TP=2 (peer all-reduce, then NCCL
#                       alone: --disable-custom-all-reduce) and TP=1, and TP=2 with --profile-steps
#   race-tp             on nvidia-h200-x2: vLLM at TP=2 (vllm_race.py --tensor-parallel-size 2), then ember
#                       at the Llama-3.1-8B shape at its defaults, one request 128/512 at TP=2, 512 x
#                       1000/1000 at TP=2 and TP=1, and at TP=2 with NCCL alone; each run's timeout is cut
#                       to what is left of the call (CALL_S, 570 s)
#   tp-70b              on nvidia-h200-x2: ember at the Llama-3.1-70B shape (141 GB of bf16 weights: two GPUs)
#                       at TP=2, one request 128/512 and 128 x 1000/1000, then vLLM at TP=2 on both in the
#                       time left of the call
#   deterministic       --deterministic (batch invariance): its GPU tests (the invariant matmul's configs at
#                       the Llama-8B shapes, the engine's cases), then the Llama-3.1-8B shape 512 x 1000/1000
#                       and one request 128/512 at the defaults and with --deterministic, then the nano
#                       protocol both ways, in the time left of the call
#   gpu-suite           every GPU test in one pytest run (`pytest -m gpu tests`): no test may leave memory
#                       behind for the next
#   serve               `ember serve` on CUDA: tests/server/test_serve_gpu.py (on two GPUs also
#                       --data-parallel-size 2), then served throughput at the Llama-3.1-8B shape, 256 x
#                       512/256 sent at once through `ember bench serve`, and the offline engine on the same
#                       workload at the server's seats and budget (what serving adds)
#   serve-race          `vllm serve` then `ember serve` (each at its defaults) on the Llama-3.1-8B shape,
#                       driven by vLLM's client (`vllm bench serve`): 256 x 512/256 at once, 512 x 1000/200
#                       at 16 requests/s, prefix_repetition at 32/s, one request 128/512, with each
#                       process's CPU per output token (serve_race.py); then ember offline on the burst
#                       (RACE_WORKLOADS: a subset; RACE_EMBER_FLAGS: flags for `ember serve`, e.g.
#                       "--api-server-count 4", its runs tagged RACE_TAG, default "flags")
#   race-vl             issue #39's vision race at the Qwen2.5-VL-7B shape (dummy weights; VL_MODEL, default .serve-vl:
#                       `python3 benchmarks/scripts/served_model.py --vl .serve-vl`): `vllm serve` then `ember serve`,
#                       each at its defaults with --max-model-len 2048 and --limit-mm-per-prompt '{"image": 1, "video": 0}',
#                       driven by ember's client (serve_race.py): 256 chat requests at once, each one 1024x768 random
#                       image then 128 text tokens, 128 out (images), the same image in all (images-shared), then vLLM's
#                       random-mm client at the same sizes (random-mm, the cross-check); first transformers' AutoProcessor
#                       on the directory in vLLM's environment (VL_WORKLOADS, VL_SERVERS: subsets; VL_EMBER_FLAGS:
#                       more of ember's flags). Carry the server wheels (.whl, as serve's), the directory and vLLM's
#                       last stage part
#                       (where an image step's GPU time goes, offline, no mode: python3 benchmarks/scripts/
#                       profile_gpu_steps.py .serve-vl --images --num-prompts 256 --input-len 128 --output-len 128
#                       --skip 4 --steps 16 --max-num-batched-tokens 8192 [--no-warmup])
#   vision-graphs       the GPU tests of the vision towers' CUDA graphs (replays against eager: Qwen2.5-VL, Qwen3-VL,
#                       Gemma 3's SigLIP at padded batches; the engine's tokens against --enforce-eager) and of
#                       the vision families on CUDA (Qwen2.5-VL / Qwen3-VL, Gemma 3, which now run with them)
#   serve-sweep [FLAGS...]  ember serve alone on the burst and the 16/s workload (SWEEP_WORKLOADS) at each
#                       seat/budget pair
#                       ("S B" strings; default: the serving defaults, 512/8192, 1024/8192, 256/8192, 512/4096)
#   spec                speculative decoding's verifying step against a decode step, one request 128/512 in CUDA
#                       graphs with 4 drafts a step always wrong, then always right (spec_verify_cost.py), at the
#                       Llama-3.1-8B and Qwen3-0.6B shapes (goal: a verifying step <= 1.15x a decode step); at both,
#                       a step with an EAGLE-3 head of random weights (--eagle3: the head's 4 forwards + the verify)
#   spec-race [PART]    issue #38's races on real weights: SmolLM2-135M-Instruct (the default model's Q4_1 GGUF,
#                       staged in parts, dequantized here to bf16 safetensors both engines load: smol_stage.py; vLLM
#                       0.24 reads no GGUF), greedy, 256 out, prefix cache off, a warm-up pass (spec_gpu_race.py):
#                       vLLM first where staged (else ember alone, saying so), then ember; one RESULT line per
#                       engine, method and batch size (tok/s and decode tok/s of none and the method, acceptance,
#                       same tokens, outputs_sha256). PART ngram (the default): one request at a time over
#                       benchmarks/spec_ngram_prompts.json, none then ngram K=4 (lookup 2..4) (vLLM's ngram imports
#                       numba: staged too, else vLLM's ngram_gpu, saying so). PART models [METHOD...]: the drafters
#                       written first into /tmp/spec-drafts (ember/bench/spec_drafts.py: a random EAGLE-3 head, seed 0,
#                       and the target's first DRAFT_LAYERS (default 4) of 30 layers: 30 is the target itself, whose
#                       drafts a greedy verify keeps nearly all of), then none, eagle3 and draft_model (METHODs: a subset)
#                       K=4, each at batch 1 (one request at a time) and batch 32 (32 prompts in one call); both
#                       engines load the same drafters, so their outputs_sha256 and accepted_tokens must agree.
#                       SPEC_ENGINES=vllm | ember: that engine alone (default vllm,ember; vLLM's eagle3 arm takes
#                       ~110 s to start, so with ember's beside it a 540-s call cut it off)
#                       The calls: below
#   frontend            issue #41's programs (`ember bench frontend`: fork-join, few-shot select, multi-turn, JSON) at
#                       the Llama-3.1-8B shape with dummy weights and SmolLM2's tokenizer (the served model directory,
#                       carried with the server wheels as serve's): in-process, over HTTP and one by one with `openai`
#   kv-tiers PART       issue #40's goals at the Llama-3.1-8B shape (dummy weights), one PART a call. multiturn:
#                       32 conversations x 6 turns of 1,000 new tokens (+ 32 out) on a 49,152-token KV pool, a
#                       32 GiB host tier (multiturn.py: its docstring has the bytes): `vllm serve` without and with
#                       --kv-offloading-size, then `ember serve` without and with --kv-offload-gib, on the served
#                       model (carried with the server wheels, as serve's); TTFT p50 / p99 of the returning turns and
#                       each server's prefix / tier counters. preempt: ember alone (vLLM 0.24 has no swap), 256 x
#                       128/2000 on 2,840 KV blocks (~1/3 of the requests preempted) with --preemption-mode recompute,
#                       swap, auto (--swap-space 32): throughput and preemptions (by swap) each. beam: LLM.beam_search,
#                       width 4, 64 x 128/128 on the served model directory (vLLM's decodes: it needs the tokenizer):
#                       vLLM (vllm_race.py --model DIR beam), then ember (beam_bench.py) on the same prompts, then
#                       ember's search again under cProfile (beam_profile.txt: where the host's time goes). cost:
#                       ember alone, 512 x 1000/1000 at the 8B shape with --kv-offload-gib 0, then at the default
#                       (on CUDA: the pool's size, at most 1/4 of the host, pinned after start-up): start-up and
#                       throughput where no prefix comes back
#
# Every kit named below is built by `bash benchmarks/scripts/device_kits.sh [whl serve-model serve-vl vllm smol]`.
#
# serve: the device has none of the server's packages and no GGUF reader, so two things are made
# here and carried: the served model (SERVED_MODEL, default .serve-model:
# `python3 benchmarks/scripts/served_model.py .serve-model`) and the wheels (SERVE_WHEELS, default
# .whl: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .whl` fastapi starlette uvicorn pydantic pydantic_core typing-inspection
# annotated-types annotated-doc typing_extensions opentelemetry-api openai httpx2 httpcore2 truststore
# anyio idna h11 httptools uvloop distro jiter sniffio partial-json-parser gguf pyzmq, at the versions of .venv).
# gguf-cuda needs the gguf wheel of that list alone.
#
# vLLM, the peer: stage it here first (/work/shared/peers/vllm-gpu/stage), copy its parts into /root/st
# in the calls before (as the stage script says), and carry its last part (VLLM_STAGE, default the
# .vllm-sN folder carried, the last where several are here) in the race call. Without it the race modes run ember alone and say so. vLLM's fp8
# path also imports compressed-tensors and loguru: add their wheels to the stage for race-fp8.
#
# spec-race: ten calls back to back (a machine goes back 30 s after a call; the tree is ~8.4 MiB of each call's 64):
#     run(command="mkdir -p /root/st && cp .vllm-s0/* /root/st/", carry=[".vllm-s0"])    52 MiB: the same for s1 to s5
#     run(command="mkdir -p /root/st && cp -r .smol-s0/. /root/st/", carry=[".smol-s0"])  51 MiB (smol_stage.py split)
#     run(command="mkdir -p /root/st && cp -r .smol-s1/. /root/st/", carry=[".smol-s1"])  50 MiB (with smol-hf/)
#     run(command="mkdir -p /root/st && cp -r .smol-s2/. /root/st/", carry=[".smol-s2"])  54 MiB (llvmlite, for numba)
#     run(command="benchmarks/scripts/h200.sh spec-race", carry=[".vllm-s6", ".whl"])    18 + 17 MiB
#     run(command="benchmarks/scripts/h200.sh spec-race models eagle3", carry=[".vllm-s6", ".whl"])  (the same
#       copies; no s2: no numba), then `spec-race models draft_model` back to back on the warm machine: one call
#       does not hold vLLM's three arms (~75 s of start-up each on an H100) beside ember's
# (.whl: the gguf wheel, for ember's GGUF decoder; SMOL_PARTS, default /root/st: where the model's parts lie)
# race-tp and tp-70b: the copy calls on nvidia-h200-x2 too (a call of another kind is another machine),
# then the mode in one call, carrying the last part; the NCCL variables are set by the mode. tp-check
# needs no vLLM: run it first, while the copies wait.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; J=$OUT; mkdir -p "$J"
Q=benchmarks/configs/qwen3-0.6b; L=benchmarks/configs/llama-3.1-8b
B="python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
NANO="--num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384"
LAT="--num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048"
TP128="--num-prompts 128 --input-len 1000 --output-len 1000 --max-model-len 2048"  # what a 70B call holds
TP="--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
TP_PREFILL="${TP/--output-len 1000/--output-len 1}"  # its prefills alone (vllm_race.py's prefill)
HF="--num-prompts 256 --input-len 512 --output-len 256 --max-model-len 1024 --max-num-seqs 256 --max-num-batched-tokens 16384 --compare hf --hf-batch-size 256"
P="python3 benchmarks/scripts/profile_gpu_steps.py"
KNOBS="--max-num-seqs %s --max-num-batched-tokens %s"  # the defaults mode's flags (seats, budget)
S=${VLLM_STAGE:-$(ls -d .vllm-s[0-9] 2>/dev/null | tail -1)}  # the carried (last) part of vLLM's stage
S=${S:-.vllm-s5}
NO_VLLM=${NO_VLLM:-0}
DEADLINE=""  # set by a mode that must end within one call: the $SECONDS by which every run has ended

# cap NAME SECONDS: a run's timeout, cut to what is left before DEADLINE; fails (and says so) when
# less than 10 s are left
cap() {
  local s=$2
  if [ -n "$DEADLINE" ] && [ $((DEADLINE - SECONDS)) -lt "$s" ]; then s=$((DEADLINE - SECONDS)); fi
  if [ "$s" -lt 10 ]; then echo "== $1: skipped, the call's time is spent" >&2; return 1; fi
  echo "$s"
}

# show: the lines of a bench log that matter (a filter that finds none is no failure)
show() { grep -E "^==|Throughput|Start-up|Roofline|Per step|KV|preempt|ember/hf|Error|error" | grep -v "^\s*$" || true; }

# bench NAME SECONDS ARGS...: one `ember bench throughput` run; JSON in $J/NAME.json, the whole log in
# $J/NAME.log, the lines that matter on stdout.
bench() {
  local name=$1 secs; secs=$(cap "ember $name" "$2") || return 0; shift 2
  echo "== ember $name: $*" | tee -a "$J/$name.log"
  timeout "$secs" $B "$@" --output-json "$J/$name.json" 2>&1 | tee -a "$J/$name.log" | show
}

# profiled NAME SECONDS ARGS...: the same run with --profile-steps (a device sync after each phase).
profiled() {
  local name=$1 secs; secs=$(cap "ember $name, --profile-steps" "$2") || return 0; shift 2
  echo "== ember $name, --profile-steps" | tee -a "$J/$name.log"
  timeout "$secs" $B "$@" --profile-steps 2>&1 | tee -a "$J/$name.log" | grep -E "Throughput|Per step" || true
}

gpu_tests() {  # gpu_tests SECONDS PYTEST-ARGS...
  local secs; secs=$(cap "GPU tests" "$1") || return 0; shift
  timeout "$secs" python3 -m pytest -m gpu -q -s -rf --tb=short "$@" 2>&1 \
    | grep -E "agreement|agrees|invariance|graph|weights:|mean \|diff\||KV blocks|identical|passed|failed|skipped|Error|^E |FAILED|\.py:[0-9]+" \
    | tail -40 | tee -a "$J/gpu_tests.log"
}

have_vllm() {
  if [ "$NO_VLLM" = 1 ]; then return 1; fi
  if [ ! -x "$S/run-on-device" ]; then
    echo "vLLM is not staged here ($S/run-on-device): ember alone (see the head of this script)"
    return 1
  fi
  # puts the last part beside the others and installs vLLM into /tmp/vllm-site; runs no workload
  # (its exit status can be its grep's, which finds no RESULT line for "none": the installed package decides too)
  "$S/run-on-device" none >/dev/null || [ -d /tmp/vllm-site/vllm ] \
    || { echo "vLLM did not install from $S: ember alone"; return 1; }
}

# vllm_race TAG SECONDS ARGS...: vLLM 0.24 on the requests ember's bench draws (vllm_race.py), first in the call.
vllm_race() {
  local tag=$1 secs; shift
  cap "vLLM $tag" "$1" >/dev/null || return 0
  have_vllm || return 0
  secs=$(cap "vLLM $tag" "$1") || return 0; shift  # what is left once it is installed
  echo "== vLLM $tag: vllm_race.py $*"
  VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/vllm-site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    timeout "$secs" python3 benchmarks/scripts/vllm_race.py "$@" 2>&1 | grep -E "^RESULT|Error|error:" \
    | tee "$J/vllm_$tag.log"
}

mode_env() {
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}

mode_smoke() {
  mode_env
  python3 -m pytest -m gpu -q -x tests/kernels 2>&1 | tail -15
  python3 -m ember.server.cli bench throughput $Q --load-format dummy --num-prompts 32 \
    --input-len 256 --output-len 128 --max-model-len 1024 --max-num-seqs 32 --profile-steps 2>&1 | tail -25
}

mode_tests() {
  gpu_tests 540 tests/kernels tests/models/test_cuda_vs_hf.py tests/models/test_cuda_families.py tests/runner
}

mode_race_nano() {
  local kv=${1:-auto}
  if have_vllm; then
    echo "== vLLM nano-vllm protocol (the peer's bench.py qwen)"
    timeout 300 "$S/run-on-device" qwen | tee "$J/vllm_nano.log"
  fi
  bench "nano_$kv" 120 $Q $NANO --kv-cache-dtype "$kv"
  profiled "nano_$kv" 120 $Q $NANO --kv-cache-dtype "$kv"
}

mode_race_llama() {
  local kv=${1:-auto}
  vllm_race "llama_$kv" 400 --config llama-3.1-8b throughput latency --kv-cache-dtype "$kv"
  bench "llama_$kv" 240 $L $TP --kv-cache-dtype "$kv"
  bench "llama_latency_$kv" 90 $L $LAT --kv-cache-dtype "$kv"
  profiled "llama_latency_$kv" 90 $L $LAT --kv-cache-dtype "$kv"
}

mode_race_latency() {
  vllm_race qwen_latency 200 --config qwen3-0.6b latency
  bench qwen_latency 60 $Q $LAT
  profiled qwen_latency 60 $Q $LAT
}

mode_hf() {
  bench hf 240 $Q $HF
}

mode_all() {
  NO_VLLM=1
  mode_env
  gpu_tests 200 tests/kernels tests/models/test_cuda_vs_hf.py tests/runner/test_cuda_graph.py
  mode_race_nano auto
  mode_hf
  mode_race_latency
  bench llama_latency_auto 90 $L $LAT
  bench llama_auto 240 $L $TP
}

mode_race_fp8() {
  vllm_race fp8 300 throughput latency --weights fp8 --kv-cache-dtype fp8
  for w in fp8 bf16; do
    local q; q=$([ $w = fp8 ] && echo "--quantization fp8" || echo "--quantization none")
    bench "llama_${w}_weights_fp8_kv" 200 $L $TP --kv-cache-dtype fp8 $q
    bench "llama_latency_${w}_weights_fp8_kv" 60 $L $LAT --kv-cache-dtype fp8 $q
  done
}

mode_check_fp8() {
  gpu_tests 540 tests/kernels/test_fp8_kernels.py tests/kernels/test_gemv.py tests/models/test_cuda_fp8.py
}

mode_check_int() {
  gpu_tests 540 tests/kernels/test_wna16_kernels.py tests/kernels/test_gemv.py tests/models/test_cuda_int_weights.py
}

mode_check_int_moe() {
  gpu_tests 400 tests/kernels/test_moe_kernels.py tests/models/test_cuda_int_moe.py -k "int_experts or moe_checkpoint"
  local secs; secs=$(cap "moe_tune --int 4" 240) || return 0
  timeout "$secs" python3 benchmarks/scripts/moe_tune.py --int 4 --tokens 1 64 512 --no-write 2>&1 \
    | grep -E "TUNED|Error" | tee "$J/moe_tune_int4.log"
}

mode_race_int() {  # race-int [awq|gptq]: issue #37's goals, one request >= 1.1x vLLM and >= 1.6x ember's bf16
  local q=${1:-awq}
  local c=benchmarks/configs/llama-3.1-8b-$q
  [ -d "$c" ] || { echo "race-int takes awq or gptq, got '$q'"; exit 2; }
  vllm_race "$q" 300 --config "llama-3.1-8b-$q" latency throughput
  bench "llama_${q}_latency" 60 $c $LAT
  bench llama_bf16_latency 60 $L $LAT
  bench "llama_$q" 200 $c $TP
}

mode_int4_kernels() {
  local secs
  gpu_tests 120 tests/kernels/test_wna16_kernels.py tests/kernels/test_gemv.py
  if secs=$(cap int4_gemv_bench 250); then
    (cd benchmarks/scripts && timeout "$secs" python3 int4_gemv_bench.py --sweep --write) 2>&1 | tee "$J/int4_gemv_bench.log"
    cp ember/kernels/int_gemv.py ember/kernels/wna16.py "$J/"  # the tuned tiles, to commit
  fi
  bench llama_awq_latency 60 benchmarks/configs/llama-3.1-8b-awq $LAT
  bench llama_bf16_latency 45 $L $LAT
  if secs=$(cap "AWQ decode profile" 90); then
    timeout "$secs" $P benchmarks/configs/llama-3.1-8b-awq --num-prompts 1 --input-len 128 --output-len 160 --skip 40 \
      --steps 60 2>&1 | grep -v Warn | head -40 | tee "$J/profile_awq_1.log"
  fi
}

mode_gguf_kernels() {
  local secs
  gguf_kit || return 0
  gpu_tests 120 tests/kernels/test_gguf_kernels.py
  if secs=$(cap gguf_gemv_bench 250); then
    (cd benchmarks/scripts && timeout "$secs" python3 gguf_gemv_bench.py --sweep --write) 2>&1 | tee "$J/gguf_gemv_bench.log"
    cp ember/kernels/gguf_gemv.py "$J/"  # the tuned tiles, to commit
  fi
}

# gguf_kit: the carried gguf wheel (the device has no GGUF reader) on PYTHONPATH, or say what is missing and fail
gguf_kit() {
  local whl=${SERVE_WHEELS:-.whl}
  if ! ls "$whl"/gguf-*.whl >/dev/null 2>&1; then
    echo "== gguf-cuda needs $whl/gguf-*.whl carried (see the head of this script)"
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$whl"/gguf-*.whl || return 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
  python3 -c "import gguf" || return 1
}

mode_gguf_cuda() {
  local f=/tmp/llama-3.1-8b-q4_k_m.gguf secs
  gguf_kit || return 0
  gpu_tests 200 tests/kernels/test_gguf_kernels.py tests/models/test_cuda_gguf.py
  if secs=$(cap "the Q4_K_M file" 120); then
    timeout "$secs" python3 -m ember.bench.dummy_gguf $L/config.json $f 2>&1 | tee "$J/dummy_gguf.log" | tail -3
  fi
  B="python3 -m ember.server.cli bench throughput --seed 0" bench llama_latency_q4_k_m 150 $f $LAT
  bench llama_latency_bf16 90 $L $LAT
  if secs=$(cap "gguf_gemv_bench" 60); then  # the GEMV's bandwidth a layer (--sweep: its tiles; a call of its own)
    (cd benchmarks/scripts && timeout "$secs" python3 gguf_gemv_bench.py) 2>&1 | tee "$J/gguf_gemv_bench.log"
  fi
}

mode_w8a8() {  # w8a8 [check|sweep|race]: one part a call
  local W=benchmarks/configs/llama-3.1-8b-w8a8 secs part=${1:-check}
  if [ "$part" = race ]; then
    vllm_race w8a8 300 --config llama-3.1-8b-w8a8 throughput
    bench llama_w8a8 200 $W $TP
    bench llama_bf16 200 $L $TP
    return
  fi
  gpu_tests 240 tests/kernels/test_int8_kernels.py tests/models/test_cuda_w8a8.py
  if secs=$(cap int8_gemm_bench 200); then
    (cd benchmarks/scripts && timeout "$secs" python3 int8_gemm_bench.py $([ "$part" = sweep ] && echo --sweep)) 2>&1 \
      | tee "$J/int8_gemm_bench.log"
  fi
  bench llama_w8a8 200 $W $TP
}

mode_kernels_fp8() {
  (cd benchmarks/scripts && timeout 540 python3 fp8_gemm_bench.py --sweep) 2>&1 | tee "$J/fp8_gemm_bench.log"
}

mode_check_moe() {
  gpu_tests 300 tests/kernels/test_moe_kernels.py tests/models/test_cuda_families.py -k "moe or mixtral"
  timeout 280 python3 benchmarks/scripts/moe_tune.py 2>&1 | grep -E "TUNED|wrote|Error" | tee "$J/moe_tune.log"
  cp ember/kernels/moe_configs.json "$J/" 2>/dev/null
  for s in qwen3-30b-a3b mixtral-8x7b; do
    bench "${s}_latency" 90 benchmarks/configs/$s $LAT
  done
}

mode_race_moe() {
  local shape=${1:-}
  local c=benchmarks/configs/$shape
  [ -n "$shape" ] && [ -d "$c" ] || { echo "race-moe SHAPE: no shape '$shape' under benchmarks/configs"; exit 2; }
  vllm_race "$shape" "${VLLM_TIMEOUT:-300}" --config "$shape" throughput prefill latency
  bench "$shape" 200 $c $TP
  bench "${shape}_prefill" 90 $c $TP_PREFILL
  bench "${shape}_latency" 60 $c $LAT
  timeout 90 $P $c --num-prompts 1 --input-len 128 --output-len 160 --skip 40 --steps 60 2>&1 | tail -30 \
    > "$J/profile_${shape}_1.log"
  timeout 120 $P $c --num-prompts 512 --input-len 1000 --output-len 80 --skip 45 --steps 20 --top 20 2>&1 \
    | tail -28 > "$J/profile_${shape}_512.log"
}

mode_race_gpt_oss() {
  local G=benchmarks/configs/gpt-oss-120b
  vllm_race gpt_oss_120b "${VLLM_TIMEOUT:-420}" --config gpt-oss-120b latency throughput256
  bench gpt_oss_120b_latency 60 $G $LAT
  bench gpt_oss_120b_256x1000 240 $G ${TP/--num-prompts 512/--num-prompts 256}
}

mode_families() {
  gpu_tests 200 tests/kernels/test_fused_ops.py tests/models/test_cuda_families.py -k "gemma or gelu"
  for m in gemma-2-9b phi-4; do
    bench "$m" 260 benchmarks/configs/$m $TP
  done
}

mode_new_families() {
  gpu_tests 150 tests/kernels/test_attention_kernels.py tests/kernels/test_fused_ops.py
  gpu_tests 200 tests/models/test_cuda_families.py -k "gpt or opt or deepseek or (phi and not phi3)"
  local D=benchmarks/configs/deepseek-v2-lite
  bench deepseek_v2_lite_latency 90 $D $LAT
  bench deepseek_v2_lite_256x1000 140 $D --num-prompts 256 --input-len 1000 --output-len 1000 --max-model-len 2048
}

mode_mla_decode() {
  gpu_tests 150 tests/kernels/test_attention_kernels.py -k "mla"
  gpu_tests 200 tests/models/test_cuda_families.py -k deepseek
  local a secs
  for a in "--sweep" fp8 "--heads 128"; do
    secs=$(cap "mla_decode_bench $a" 120) || break
    timeout "$secs" python3 benchmarks/scripts/mla_decode_bench.py $a 2>&1 | tee -a "$J/mla_decode_bench.log"
  done
}

mode_gpt_oss() {
  gpu_tests 240 tests/kernels/test_moe_kernels.py -k "mxfp4 or gpt_oss or biased or real_shapes"
  gpu_tests 200 tests/models/test_cuda_families.py -k gpt_oss
  local G=benchmarks/configs/gpt-oss-120b
  bench gpt_oss_120b_latency 150 $G $LAT
  bench gpt_oss_120b_256x1000 200 $G --num-prompts 256 --input-len 1000 --output-len 1000 --max-model-len 2048
}

mode_spec() {
  local secs shape
  for shape in "$L llama_8b" "$Q qwen3_0_6b"; do
    set -- $shape
    if secs=$(cap spec_verify_$2 270); then
      timeout "$secs" python3 benchmarks/scripts/spec_verify_cost.py $1 --load-format dummy --k 4 --input-len 128 \
        --output-len 512 --eagle3 --output-json "$J/spec_verify_$2.json" > "$J/spec_verify_$2.log" 2>&1
      tail -1 "$J/spec_verify_$2.log" | sed "s/^/$2: /"
    fi
  done
}

# spec-race [ngram|models [METHOD...]]: each engine's arms in processes of their own (spec_gpu_race.py), vLLM's
# capped to leave ember its part of the call (ngram: 180 s; models: 90 s and 100 s a method)
mode_spec_race() {
  local what=${1:-ngram}; [ $# -gt 0 ] && shift
  local parts=${SMOL_PARTS:-/root/st} m=/tmp/smollm2-bf16 drafts=/tmp/spec-drafts secs keep=180 methods="" flags="" x
  case "$what" in
    ngram) ;;
    models) methods=${*:-eagle3 draft_model}
      for x in $methods; do
        case "$x" in eagle3|draft_model) ;; *) echo "== spec-race models: no method '$x' (eagle3, draft_model)"; return 2 ;; esac
      done
      keep=$((90 + 100 * $(echo $methods | wc -w))) ;;
    *) echo "== spec-race: no part '$what' (ngram, or models [eagle3] [draft_model])"; return 2 ;;
  esac
  local engines=",${SPEC_ENGINES:-vllm,ember},"  # one engine a call where both do not fit (vLLM's eagle3: ~110 s to start)
  [[ $engines == *,ember,* ]] || keep=0
  local race="benchmarks/scripts/spec_gpu_race.py --model $m --max-tokens 256 --k 4"
  if [ "$what" = ngram ]; then
    race="$race --lookup 2 4"
  else
    race="$race --methods $methods --batch 1 32 --drafts-dir $drafts --draft-layers ${DRAFT_LAYERS:-4}"
  fi
  if [ ! -f "$parts/smol-part0" ] || [ ! -d "$parts/smol-hf" ]; then
    echo "== spec-race needs the model's parts in $parts: copy .smol-s0 and .smol-s1 first (see the head of this script)"
    return 0
  fi
  gguf_kit || return 0
  secs=$(cap "the model's bf16 weights" 90) || return 0
  timeout "$secs" python3 benchmarks/scripts/smol_stage.py unpack "$parts" $m 2>&1 | tail -3 | tee "$J/smol_stage.log"
  if [ "$what" = models ]; then  # written once (kept where there), loaded by both engines
    secs=$(cap "the drafts" 60) || return 0
    timeout "$secs" python3 -m ember.bench.spec_drafts $m $drafts --layers ${DRAFT_LAYERS:-4} 2>&1 | tail -3 | tee "$J/spec_drafts.log"
  fi
  local vllm=0 method=ngram  # vLLM's ngram proposer imports numba: the staged wheels (smol_stage.py) where the image lacks it
  [[ $engines == *,vllm,* ]] && have_vllm && vllm=1
  if [ $vllm = 1 ] && [ $((DEADLINE - SECONDS - keep)) -lt 60 ]; then
    echo "== vLLM spec race: skipped, the call's time is spent (ember's $keep s kept)"
  elif [ $vllm = 1 ]; then
    if [ "$what" = ngram ] && ! PYTHONPATH=/tmp/vllm-site python3 -c "import numba" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site \
        "$parts"/numba-*.whl "$parts"/llvmlite-*.whl 2>&1 | tail -2
      PYTHONPATH=/tmp/vllm-site python3 -c "import numba" \
        || { method=ngram_gpu; echo "== numba does not import (copy .smol-s0 and .smol-s2): vLLM's ngram_gpu instead"; }
    fi
    [ "$what" = ngram ] && flags="--vllm-method $method"
    secs=$((DEADLINE - SECONDS - keep))
    echo "== vLLM ${methods:-$method} race: $race --engine vllm${flags:+ $flags}"
    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/vllm-site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
      timeout "$secs" python3 $race --engine vllm $flags 2>&1 | tee "$J/spec_race_vllm${methods:+_models}.log" \
      | grep -E "^RESULT|Error|error:" || true
  fi
  [[ $engines == *,ember,* ]] || return 0
  secs=$(cap "ember spec race" $((keep + 60))) || return 0
  echo "== ember ${methods:-ngram} race: $race --engine ember"
  timeout "$secs" python3 $race --engine ember 2>&1 | tee "$J/spec_race_ember${methods:+_models}.log" \
    | grep -E "^RESULT|Error|error:" || true
}

mode_frontend() {  # each arm set in its own process: the in-process engine's GPU memory is gone before the server's
  local m=${SERVED_MODEL:-.serve-model} secs arms
  serve_kit || return 0
  for arms in in-process http,openai; do
    secs=$(cap "frontend $arms" 270) || return 0
    timeout "$secs" python3 -m ember.server.cli bench frontend --model "$m" --load-format dummy --dtype bfloat16 \
      --seed 0 --max-model-len 4096 --arms $arms --out "$J/frontend_${arms%%,*}.json" 2>&1 \
      | tee "$J/frontend_${arms%%,*}.log" | grep -E "^\|" || true
  done
}

# kv-tiers preempt: a request ends at 2,128 tokens = 17 blocks of 128; 2,840 blocks hold 167 of the 256 (256 seats:
# defaults.seats_that_fit), so once the pool fills ~1/3 are preempted (at 1/8 the lengths on the CPU, 24 x 16/250 on
# 266 blocks of 16 tokens: 9 of 24); their swapped blocks take <= 89 x 17 x 16 MiB = 24 GiB of the 32 GiB swap space
KV_PREEMPT="--num-prompts 256 --input-len 128 --output-len 2000 --max-model-len 2304 --num-kv-blocks 2840"

mode_kv_tiers() {  # kv-tiers multiturn|preempt|beam|cost: one part a call
  local part=${1:-} m=${SERVED_MODEL:-.serve-model} secs arms=vllm,vllm-offload,ember,ember-tier pm
  case "$part" in
    multiturn)
      serve_kit || return 0
      have_vllm || arms=ember,ember-tier
      secs=$(cap "kv-tiers multiturn" 560) || return 0
      timeout "$secs" python3 benchmarks/scripts/multiturn.py "$m" --out "$J" --arms "$arms" --deadline $((secs - 10)) \
        2>&1 | tee "$J/multiturn.log" | grep -E "^RESULT|^RATIO|^==|Error" || true ;;
    preempt)
      for pm in recompute swap auto; do
        bench "preempt_$pm" 180 $L $KV_PREEMPT --preemption-mode $pm $([ $pm = recompute ] || echo --swap-space 32)
      done ;;
    beam)
      [ -f "$m/tokenizer.json" ] || { echo "== kv-tiers beam needs $m/ carried (see the head of this script)"; return 0; }
      vllm_race beam 300 --model "$m" beam
      secs=$(cap "ember beam" 200) || return 0
      timeout "$secs" python3 benchmarks/scripts/beam_bench.py "$m" --output-json "$J/beam_ember.json" \
        --profile "$J/beam_profile.txt" 2>&1 \
        | tee "$J/beam_ember.log" | grep -E "^RESULT|Error" || true ;;
    cost)  # what the tier costs where nothing comes back (every prompt new, the pool churning): off, then the
      # default (on CUDA: the pool's size, at most 1/4 of the host's memory, pinned after start-up)
      bench tier_cost_0 270 $L $TP --kv-offload-gib 0
      bench tier_cost_default 270 $L $TP ;;
    *) echo "kv-tiers takes multiturn, preempt, beam or cost, got '$part'"; exit 2 ;;
  esac
}

mode_moe_speed() {  # moe-speed [kernels|engines]: one part a call
  local secs G=benchmarks/configs/gpt-oss-120b D=benchmarks/configs/deepseek-v2-lite
  if [ "${1:-kernels}" = kernels ]; then
    gpu_tests 150 tests/kernels/test_moe_kernels.py -k "${MOE_TESTS:-moe or expert or route or align}"
    if secs=$(cap moe_tune 240); then
      timeout "$secs" python3 benchmarks/scripts/moe_tune.py --shapes ${MOE_TUNE_SHAPES:-gpt-oss-120b deepseek-v2-lite} \
        --tokens ${MOE_TUNE_TOKENS:-1 2 4 8 16 64 512} 2>&1 | grep -E "TUNED|wrote|Error" | tee "$J/moe_tune.log"
      cp ember/kernels/moe_configs.json "$J/"
    fi
    gpu_tests 120 tests/models/test_cuda_families.py -k gpt_oss
    return
  fi
  bench gpt_oss_120b_latency 120 $G $LAT
  if secs=$(cap "gpt-oss-120b decode profile" 100); then
    timeout "$secs" $P $G --num-prompts 1 --input-len 128 --output-len 160 2>&1 | grep -v Warn | head -30 \
      | tee "$J/profile_gpt_oss_120b_1.log"
  fi
  bench deepseek_v2_lite_512x1000 100 $D $TP
  profiled deepseek_v2_lite_512x1000 100 $D $TP
  if secs=$(cap "DeepSeek-V2-Lite decode profile at 512" 100); then  # the kernels and the host's ops a step
    timeout "$secs" $P $D --num-prompts 512 --input-len 1000 --output-len 120 --skip 40 --steps 40 --top 22 2>&1 \
      | grep -v Warn | tee "$J/profile_deepseek_v2_lite_512.log" | tail -50
  fi
}

mode_sweep_decode() {
  local dt=${1:-bf16} kv=auto
  [ "$dt" = fp8 ] && kv=fp8
  python3 benchmarks/scripts/decode_sweep.py "$dt" 2>&1 | grep -v Error | tee "$J/sweep_$dt.log"
  local best; best=$(grep BEST_QWEN "$J/sweep_$dt.log" | cut -d= -f2)
  bench "nano_${kv}_default_config" 120 $Q $NANO --kv-cache-dtype $kv
  EMBER_DECODE_CONFIG=$best bench "nano_${kv}_config_$best" 120 $Q $NANO --kv-cache-dtype $kv
  EMBER_DECODE_CONFIG=$best bench "llama_${kv}_config_$best" 240 $L $TP --kv-cache-dtype $kv
}

mode_defaults() {
  local base=${NANO% --max-num-seqs*} flags
  for f in "" "256 16384" "1024 16384"; do
    flags=""; [ -n "$f" ] && flags=$(printf -- "$KNOBS" $f)
    f=${f:-defaults}; bench "nano_${f// /_}" 120 $Q $base $flags
  done
  base=${TP% --max-num-seqs*}
  for f in "" "384 16384" "448 16384" "512 16384"; do
    flags=""; [ -n "$f" ] && flags=$(printf -- "$KNOBS" $f)
    f=${f:-defaults}; bench "llama_${f// /_}" 150 $L $base $flags
  done
  bench llama_mp 150 $L $base --distributed-executor-backend mp
  gpu_tests 120 tests/runner/test_defaults.py
}

# NVLink multicast stays off on the lent GPUs (the device README's KINDS.md says why), in NCCL,
# torch's symmetric memory and vLLM's symmetric-memory all-reduce
multicast_off() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
}

SERVED_FLAGS="--load-format dummy --dtype bfloat16 --seed 0 --max-model-len 2048"
SERVED_LOAD="--dataset random --num-prompts 256 --random-input-len 512 --random-output-len 256 --ignore-eos --seed 0"

# serve_kit: install the carried server wheels (PYTHONPATH), or say what is missing and fail
serve_kit() {
  local whl=${SERVE_WHEELS:-.whl} m=${SERVED_MODEL:-.serve-model}
  if ! ls "$whl"/*.whl >/dev/null 2>&1 || [ ! -f "$m/tokenizer.json" ]; then
    echo "== serve needs $whl/*.whl and $m/ carried (see the head of this script)"
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$whl"/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
  python3 -c "import fastapi, uvicorn, httptools, openai, pydantic, partial_json_parser, gguf, zmq" || return 1
}

# served NAME SECONDS MODEL ARGS...: `ember serve MODEL ARGS` in the background, `ember bench serve`
# ($SERVED_LOAD) against it once it answers /health, then SIGTERM; JSON in $J/NAME.json
served() {
  local name=$1 secs m=$3 port=8123 waited=0 pid; secs=$(cap "ember $name" "$2") || return 0; shift 3
  echo "== ember $name: serve $m $*" | tee -a "$J/$name.log"
  python3 -m ember.server.cli serve "$m" --port $port "$@" >"$J/$name.server.log" 2>&1 &
  pid=$!
  until python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" \
      2>/dev/null; do
    sleep 2; waited=$((waited + 2))
    if [ $waited -ge $((secs / 2)) ] || ! kill -0 $pid 2>/dev/null; then
      echo "== ember $name: the server did not answer within $waited s"; tail -20 "$J/$name.server.log"
      kill $pid 2>/dev/null; return 1
    fi
  done
  timeout $((secs - waited)) python3 -m ember.server.cli bench serve --base-url http://127.0.0.1:$port \
    --tokenizer "$m" $SERVED_LOAD --output-json "$J/$name.json" 2>&1 | tee -a "$J/$name.log" | tail -25
  kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
}

mode_serve() {
  local m=${SERVED_MODEL:-.serve-model}
  serve_kit || return 0
  EMBER_SERVED_MODEL=$m gpu_tests 330 tests/server/test_serve_gpu.py
  served served_256 150 "$m" $SERVED_FLAGS
  bench offline_256 90 "$m" --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 2048 \
    --max-num-seqs 256 --max-num-batched-tokens 2048
}

mode_serve_race() {
  local m=${SERVED_MODEL:-.serve-model} secs
  serve_kit || return 0
  have_vllm || return 0
  local w=${RACE_WORKLOADS:-burst,rate16,prefix,one}
  secs=$(cap "serve race" 470) || return 0
  timeout "$secs" python3 benchmarks/scripts/serve_race.py "$m" --out "$J" --workloads "$w" --deadline $((secs - 10)) \
    ${RACE_EMBER_FLAGS:+--ember-flags "$RACE_EMBER_FLAGS" --tag "${RACE_TAG:-flags}"} \
    2>&1 | tee "$J/serve_race.log" | grep -E "^RESULT|^==|Error"
  case ",$w," in *,burst,*)
    bench offline_burst 80 "$m" --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 2048 ;;
  esac
}

# vl_processor DIR: transformers' AutoProcessor on the directory in vLLM's environment, as vLLM loads it
# (Qwen2_5_VLProcessor: its video part imports torchvision, which the device image holds)
vl_processor() {
  PYTHONPATH=/tmp/vllm-site HF_HUB_OFFLINE=1 python3 -c "import sys, transformers; \
p = transformers.AutoProcessor.from_pretrained(sys.argv[1]); \
print('== AutoProcessor:', type(p).__name__, type(p.image_processor).__name__, p.image_token, p.image_token_id)" "$1"
}

# vllm_blake3: vLLM's image hashing imports blake3, which its stage lacks: the carried wheel into its site
vllm_blake3() {
  PYTHONPATH=/tmp/vllm-site python3 -c "import blake3" 2>/dev/null && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site \
    "${SERVE_WHEELS:-.whl}"/blake3-*.whl && PYTHONPATH=/tmp/vllm-site python3 -c "import blake3" \
    || { echo "== race-vl: vLLM needs blake3 (.whl/blake3-*.whl: device_kits.sh whl)"; return 1; }
}

mode_vision_graphs() {
  gpu_tests 540 tests/runner/test_tower_graphs.py tests/models/test_cuda_qwen_vl.py tests/models/test_cuda_gemma3_vision.py
}

mode_race_vl() {
  local m=${VL_MODEL:-.serve-vl} servers=${VL_SERVERS:-vllm,ember} secs
  local flags="--limit-mm-per-prompt '{\"image\": 1, \"video\": 0}'"
  SERVED_MODEL=$m serve_kit || return 0
  export VLLM_USE_FLASHINFER_SAMPLER=0  # vLLM's sampler would import flashinfer, which the device lacks
  case ",$servers," in *,vllm,*)
    if ! have_vllm || ! vllm_blake3 || ! vl_processor "$m"; then servers=ember; echo "== race-vl: ember alone"; fi ;;
  esac
  secs=$(cap "race-vl" 540) || return 0
  timeout "$secs" python3 benchmarks/scripts/serve_race.py "$m" --out "$J" --servers "$servers" \
    --workloads "${VL_WORKLOADS:-images,images-shared,random-mm}" --max-model-len 2048 \
    --ember-flags "$flags${VL_EMBER_FLAGS:+ $VL_EMBER_FLAGS}" --vllm-flags "$flags" --deadline $((secs - 10)) \
    2>&1 | tee "$J/race_vl.log" | grep -E "^RESULT|^==|Error" || true
}

mode_serve_sweep() {
  local m=${SERVED_MODEL:-.serve-model} secs f flags
  serve_kit || return 0
  have_vllm || return 0  # its client
  [ $# -gt 0 ] || set -- "" "512 8192" "1024 8192" "256 8192" "512 4096"
  for f in "$@"; do
    flags=""; [ -n "$f" ] && flags=$(printf -- "$KNOBS" $f)
    secs=$(cap "sweep $f" 110) || return 0
    timeout "$secs" python3 benchmarks/scripts/serve_race.py "$m" --out "$J" --servers ember \
      --workloads "${SWEEP_WORKLOADS:-burst,rate16}" \
      --ember-flags "$flags" --tag "${f:-defaults}" --deadline $((secs - 5)) 2>&1 | grep -E "^RESULT|^==|Error" || true
  done
}

mode_tp_check() {
  multicast_off
  gpu_tests 270 tests/distributed/test_peer_all_reduce_gpu.py tests/distributed/test_tensor_parallel_gpu.py
  local secs
  if secs=$(cap "all-reduce bench" 60); then
    echo "== all-reduce, NCCL against peer memory"
    timeout "$secs" python3 benchmarks/scripts/all_reduce_bench.py --ranks 2 --output-json "$J/all_reduce.json" 2>&1 \
      | grep -vi "warning" | tee "$J/all_reduce.log"
  fi
  bench llama_latency_tp2 60 $L $LAT --tensor-parallel-size 2
  bench llama_latency_tp2_nccl 60 $L $LAT --tensor-parallel-size 2 --disable-custom-all-reduce
  bench llama_latency_tp1 45 $L $LAT
  profiled llama_latency_tp2 60 $L $LAT --tensor-parallel-size 2
}

mode_race_tp() {
  multicast_off
  local base=${TP% --max-num-seqs*}  # ember at its defaults: no seat or budget flag
  vllm_race llama_tp2 240 --config llama-3.1-8b --tensor-parallel-size 2 throughput latency
  bench llama_latency_tp2 60 $L $LAT --tensor-parallel-size 2
  bench llama_tp2 100 $L $base --tensor-parallel-size 2
  bench llama_tp1 100 $L $base
  bench llama_tp2_nccl 100 $L $base --tensor-parallel-size 2 --disable-custom-all-reduce
}

mode_tp_70b() {
  multicast_off
  local c=benchmarks/configs/llama-3.1-70b
  bench llama70b_latency_tp2 120 $c $LAT --tensor-parallel-size 2
  bench llama70b_128_tp2 200 $c $TP128 --tensor-parallel-size 2
  vllm_race llama70b_tp2 400 --config llama-3.1-70b --tensor-parallel-size 2 throughput128 latency
}

mode_deterministic() {
  gpu_tests 200 tests/kernels/test_matmul.py tests/models/test_cuda_deterministic.py
  bench llama_default 120 $L $TP
  bench llama_deterministic 200 $L $TP --deterministic
  bench llama_latency_default 60 $L $LAT
  bench llama_latency_deterministic 60 $L $LAT --deterministic
  bench nano_default 90 $Q $NANO
  bench nano_deterministic 120 $Q $NANO --deterministic
}

mode_gpu_suite() {
  local secs; secs=$(cap "GPU suite" 560) || return 0
  timeout "$secs" python3 -m pytest -m gpu -q -rfs --tb=short --durations=15 --continue-on-collection-errors tests 2>&1 \
    | tee "$J/gpu_suite.log" \
    | grep -E "passed|failed|skipped|Error|^E |FAILED|SKIPPED|s call|s setup" | tail -60
}

mode=${1:-}
[ $# -gt 0 ] && shift
multicast_off  # every mode: the product leaves NVLink multicast to the user; a lent GPU must not use it
case "$mode" in
  env) mode_env ;;
  smoke) mode_smoke ;;
  tests) mode_env; mode_tests ;;
  race-nano) mode_env; mode_race_nano "$@" ;;
  race-llama) mode_env; mode_race_llama "$@" ;;
  race-latency) mode_env; mode_race_latency ;;
  hf) mode_env; mode_hf ;;
  all) mode_all ;;
  race-fp8) mode_env; mode_race_fp8 ;;
  check-fp8) mode_env; mode_check_fp8 ;;
  check-int) mode_env; mode_check_int ;;
  check-int-moe) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_check_int_moe ;;
  gguf-cuda) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_gguf_cuda ;;
  int4-kernels) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_int4_kernels ;;
  gguf-kernels) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_gguf_kernels ;;
  race-int) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_race_int "$@" ;;
  w8a8) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_w8a8 "$@" ;;
  kernels-fp8) mode_env; mode_kernels_fp8 ;;
  check-moe) mode_env; mode_check_moe ;;
  race-moe) mode_env; mode_race_moe "$@" ;;
  race-gpt-oss) DEADLINE=$((SECONDS + ${CALL_S:-585})); mode_env; mode_race_gpt_oss ;;
  families) mode_env; mode_families ;;
  new-families) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_new_families ;;
  mla-decode) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_mla_decode ;;
  gpt-oss) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_gpt_oss ;;
  moe-speed) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_moe_speed "$@" ;;
  spec) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_spec ;;
  spec-race) DEADLINE=$((SECONDS + ${CALL_S:-540})); mode_env; mode_spec_race "$@" ;;
  frontend) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_frontend ;;
  kv-tiers) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_kv_tiers "$@" ;;
  sweep-decode) mode_env; mode_sweep_decode "$@" ;;
  defaults) mode_env; mode_defaults ;;
  tp-check) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_tp_check ;;
  race-tp) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_race_tp ;;
  tp-70b) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_tp_70b ;;
  serve) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_serve ;;
  serve-race) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_serve_race ;;
  race-vl) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_race_vl ;;
  vision-graphs) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_vision_graphs ;;
  serve-sweep) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_serve_sweep "$@" ;;
  deterministic) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_deterministic ;;
  gpu-suite) DEADLINE=$((SECONDS + ${CALL_S:-570})); mode_env; mode_gpu_suite ;;
  *) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2 ;;
esac
