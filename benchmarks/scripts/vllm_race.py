"""vLLM 0.24 on the requests `ember bench throughput` draws for the same flags (ember/bench/
throughput.py `random_requests`: the same token ids and lengths, seed 0, no special ids
since the config directory has no tokenizer), at a shape from benchmarks/configs:

    throughput     512 x 1000/1000
    throughput128  128 x 1000/1000 (a 70B shape's KV pool and a device call's time hold no more)
    latency        one request, 128 in / 512 out

One engine serves both (started once: a large model's start-up takes minutes) with
max_num_seqs 512, max_num_batched_tokens 16384, max_model_len 2048, the flags ember's bench
gets for the throughput workload.

Sampling as ember's bench: temperature 1.0, top_p 1.0, ignore_eos, max_tokens = the
request's output length; only the generate call is timed, after a tiny warm-up. Dummy
weights; `--weights fp8` is vLLM's online per-tensor quantization of them; `--kv-cache-dtype
fp8` its fp8 cache; `--tensor-parallel-size N` splits the model over N GPUs (vLLM's own
tensor parallelism; h200.sh race-tp and tp-70b set the NCCL environment). One RESULT line
(JSON) a workload. Run on the device with vLLM staged (/work/shared/peers/vllm-gpu/stage;
h200.sh race-llama, race-latency, race-fp8, race-moe, race-tp, tp-70b):

    python3 benchmarks/scripts/vllm_race.py --config llama-3.1-8b [throughput] [throughput128] [latency]
        [--weights bf16|fp8] [--kv-cache-dtype auto|fp8] [--tensor-parallel-size N]"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # ember's random_requests, for the same prompts as ember's bench

WORKLOADS = {  # name: ember bench flags as numbers
    "throughput": dict(num_prompts=512, input_len=1000, output_len=1000),
    "throughput128": dict(num_prompts=128, input_len=1000, output_len=1000),
    "latency": dict(num_prompts=1, input_len=128, output_len=512),
}
LIMITS = dict(max_model_len=2048, max_num_seqs=512, max_num_batched_tokens=16384)


def requests(config_dir: Path, num_prompts: int, input_len: int, output_len: int):
    from ember.bench.throughput import random_requests

    vocab = json.loads((config_dir / "config.json").read_text())["vocab_size"]
    return random_requests(num_prompts, input_len, output_len, 0.0, vocab, [], seed=0)


def start(config: str, weights: str, kv_cache_dtype: str, tensor_parallel_size: int):
    from vllm import LLM, SamplingParams

    quant = {"quantization": "fp8"} if weights == "fp8" else {}
    t0 = time.time()
    llm = LLM(model=str(ROOT / "benchmarks" / "configs" / config), load_format="dummy", skip_tokenizer_init=True,
              gpu_memory_utilization=0.9, seed=0, kv_cache_dtype=kv_cache_dtype,
              tensor_parallel_size=tensor_parallel_size, **quant, **LIMITS)
    startup = time.time() - t0
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    return llm, startup


def run(llm, startup: float, config: str, name: str, weights: str, kv_cache_dtype: str,
        tensor_parallel_size: int) -> dict:
    from vllm import SamplingParams

    shape = WORKLOADS[name]
    reqs = requests(ROOT / "benchmarks" / "configs" / config, **shape)
    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len,
                             detokenize=False) for r in reqs]
    t = time.time()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    dt = time.time() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    result = dict(config=config, workload=f"{name}: {shape['num_prompts']} x {shape['input_len']}/{shape['output_len']}",
                  weights=weights, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
                  startup_s=round(startup, 1), seconds=round(dt, 2),
                  prompt_tokens=prompt_tokens, output_tokens=out_tokens, output_tok_s=round(out_tokens / dt, 1),
                  total_tok_s=round((prompt_tokens + out_tokens) / dt, 1))
    print("RESULT", json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="*", help=f"of {list(WORKLOADS)} (default: throughput latency)")
    ap.add_argument("--config", default="llama-3.1-8b")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over (vLLM's TP)")
    ns = ap.parse_args()
    if unknown := set(ns.workloads) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(unknown)}: choose from {list(WORKLOADS)}")
    if ns.tensor_parallel_size < 1:
        ap.error(f"--tensor-parallel-size must be >= 1; got {ns.tensor_parallel_size}")
    engine, seconds = start(ns.config, ns.weights, ns.kv_cache_dtype, ns.tensor_parallel_size)
    for name in ns.workloads or ["throughput", "latency"]:
        run(engine, seconds, ns.config, name, ns.weights, ns.kv_cache_dtype, ns.tensor_parallel_size)
