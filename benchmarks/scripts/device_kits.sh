#!/bin/bash
# The kits the device calls carry (ignored folders at the repo root; h200.sh's head says which mode
# needs which), built here in one command: a fresh checkout has none of them.
#
#   bash benchmarks/scripts/device_kits.sh [KIT ...]     (default: whl serve-model vllm)
#
#   whl          .whl: the server's wheels for the device's Python 3.12 at the versions of .venv (fastapi,
#                uvicorn, openai, pyzmq, ...), gguf, xgrammar with apache-tvm-ffi, compressed-tensors, loguru,
#                blake3 (vLLM's image hashes)
#   serve-model  .serve-model: the Llama-3.1-8B shape with SmolLM2's tokenizer (served_model.py)
#   serve-vl     .serve-vl: the Qwen2.5-VL-7B shape (served_model.py --vl)
#   vllm         .vllm-s0 ... : vLLM 0.24's stage (../shared/peers/vllm-gpu/stage), cut again into parts of
#                52 MiB, so each part fits a call beside the tracked tree (its 58 MiB parts do not), the
#                runner and bench.py in the last part
#   smol         .smol-s0 ... .smol-s2: SmolLM2's GGUF and numba / llvmlite for spec-race (smol_stage.py split)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'make setup' first"; exit 1; }

version() {  # the version .venv has of a package, or the pin given
  local v; v=$("$PY" -m pip show "$1" 2>/dev/null | awk '/^Version/ {print $2}')
  echo "${v:-${2:?$1 is not in .venv and has no pin}}"
}

kit_whl() {
  local specs=() p
  for p in fastapi starlette uvicorn pydantic pydantic_core typing-inspection annotated-types annotated-doc \
      typing_extensions opentelemetry-api openai httpx2 httpcore2 truststore anyio idna h11 httptools uvloop distro \
      jiter sniffio partial-json-parser gguf pyzmq xgrammar apache-tvm-ffi; do
    specs+=("$p==$(version "$p")")
  done
  specs+=("compressed-tensors==$(version compressed-tensors 0.20.1)" "loguru==$(version loguru 0.7.3)")
  specs+=("blake3==$(version blake3 1.0.11)")  # vLLM's multimodal hashing (race-vl); its stage lacks it
  mkdir -p .whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${specs[@]}"
  du -sh .whl
}

kit_vllm() {
  local cache=${EMBER_PEERS:-$HOME/.cache/ember-peers}/vllm-0.24.0 last
  bash ../shared/peers/vllm-gpu/stage >/dev/null
  rm -rf .vllm-s[0-9]
  split -b 52M -d -a 1 "$cache/all.tar" "$cache/part"
  for p in "$cache"/part?; do mkdir -p ".vllm-s${p##*part}"; mv "$p" ".vllm-s${p##*part}/"; done
  last=$(ls -d .vllm-s? | tail -1)
  cp ../shared/peers/vllm-gpu/run-on-device ../shared/peers/vllm-gpu/bench.py "$last/"
  du -sh .vllm-s?
}

for kit in "${@:-whl serve-model vllm}"; do
  for k in $kit; do
    echo "== $k"
    case $k in
      whl) kit_whl ;;
      serve-model) "$PY" benchmarks/scripts/served_model.py .serve-model ;;
      serve-vl) "$PY" benchmarks/scripts/served_model.py --vl .serve-vl ;;
      vllm) kit_vllm ;;
      smol) "$PY" benchmarks/scripts/smol_stage.py split ;;
      *) echo "unknown kit '$k': whl, serve-model, serve-vl, vllm or smol"; exit 2 ;;
    esac
  done
done
