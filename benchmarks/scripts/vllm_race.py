"""vLLM 0.24 on the requests `ember bench throughput` draws for the same flags (ember/bench/
throughput.py `random_requests`: the same token ids and lengths, seed 0, no special ids
since the config directory has no tokenizer), at a shape from benchmarks/configs:

    throughput     512 x 1000/1000
    throughput128  128 x 1000/1000 (a 70B shape's KV pool and a device call's time hold no more)
    throughput256  256 x 1000/1000 (issue #36's gpt-oss-120b workload)
    prefill        512 x 1000/1: the throughput workload's prefills alone (its seconds: the prefill time)
    latency        one request, 128 in / 512 out
    beam           LLM.beam_search, width 4, 64 x 128/128, ignore_eos (issue #40; ember's side:
                   beam_bench.py on the same prompts and limits): vLLM's beam search decodes each
                   sequence, so give it a directory with a tokenizer (--model, the served model)

One engine serves them all (started once: a large model's start-up takes minutes) with
max_num_seqs 512, max_num_batched_tokens 16384, max_model_len 2048, the flags ember's bench
gets for the throughput workload.

Sampling as ember's bench: temperature 1.0, top_p 1.0, ignore_eos, max_tokens = the
request's output length; only the generate call is timed, after a tiny warm-up. Dummy
weights; `--weights fp8` is vLLM's online per-tensor quantization of them; `--kv-cache-dtype
fp8` its fp8 cache; `--tensor-parallel-size N` splits the model over N GPUs (vLLM's own
tensor parallelism; h200.sh race-tp and tp-70b set the NCCL environment); `--model DIR` a
model directory in place of benchmarks/configs/CONFIG (its config.json's vocab_size draws the
prompts). One RESULT line (JSON) a workload; beam's output_tok_s as `vllm bench throughput`
counts a beam run (prompts x max_tokens / s), its sequence_tok_s the returned sequences' generated
tokens / s. Run on the device with vLLM staged (/work/shared/peers/vllm-gpu/stage;
h200.sh race-llama, race-latency, race-fp8, race-moe, race-tp, tp-70b):

    python3 benchmarks/scripts/vllm_race.py --config llama-3.1-8b [throughput] [throughput128] [latency]
        [--weights bf16|fp8] [--kv-cache-dtype auto|fp8] [--tensor-parallel-size N] [--model DIR]"""

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
    "throughput256": dict(num_prompts=256, input_len=1000, output_len=1000),
    "prefill": dict(num_prompts=512, input_len=1000, output_len=1),  # the throughput workload's prefills alone
    "latency": dict(num_prompts=1, input_len=128, output_len=512),
    "beam": dict(num_prompts=64, input_len=128, output_len=128, beam_width=4),
}
LIMITS = dict(max_model_len=2048, max_num_seqs=512, max_num_batched_tokens=16384)


def requests(config_dir: Path, num_prompts: int, input_len: int, output_len: int):
    from ember.bench.throughput import random_requests

    vocab = json.loads((config_dir / "config.json").read_text())["vocab_size"]
    return random_requests(num_prompts, input_len, output_len, 0.0, vocab, [], seed=0)


def start(model: Path, weights: str, kv_cache_dtype: str, tensor_parallel_size: int):
    from vllm import LLM, SamplingParams

    quant = {"quantization": "fp8"} if weights == "fp8" else {}
    t0 = time.time()
    tokenizer = (model / "tokenizer.json").exists()
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=not tokenizer,
              gpu_memory_utilization=0.9, seed=0, kv_cache_dtype=kv_cache_dtype,
              tensor_parallel_size=tensor_parallel_size, **quant, **LIMITS)
    startup = time.time() - t0
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    return llm, startup


def run_beam(llm, model: Path, startup: float) -> dict:
    from vllm.sampling_params import BeamSearchParams

    shape = dict(WORKLOADS["beam"])
    width = shape.pop("beam_width")
    reqs = requests(model, **shape)
    llm.beam_search([{"prompt_token_ids": [1, 2, 3, 4]}], BeamSearchParams(beam_width=width, max_tokens=2,
                                                                            ignore_eos=True))
    params = BeamSearchParams(beam_width=width, max_tokens=shape["output_len"], ignore_eos=True)
    t = time.time()
    outs = llm.beam_search([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params)
    dt = time.time() - t
    generated = sum(len(s.tokens) - shape["input_len"] for o in outs for s in o.sequences)
    result = dict(engine="vllm", model=str(model), workload=f"beam: {shape['num_prompts']} x {shape['input_len']}/"
                  f"{shape['output_len']}, width {width}", startup_s=round(startup, 1), seconds=round(dt, 2),
                  output_tok_s=round(shape["num_prompts"] * shape["output_len"] / dt, 1),
                  sequence_tokens=generated, sequence_tok_s=round(generated / dt, 1))
    print("RESULT", json.dumps(result), flush=True)
    return result


def run(llm, startup: float, config: str, name: str, weights: str, kv_cache_dtype: str,
        tensor_parallel_size: int, model: Path) -> dict:
    from vllm import SamplingParams

    if name == "beam":
        return run_beam(llm, model, startup)
    shape = WORKLOADS[name]
    reqs = requests(model, **shape)
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
    ap.add_argument("--model", type=Path, default=None, help="a model directory (default: benchmarks/configs/CONFIG)")
    ns = ap.parse_args()
    if unknown := set(ns.workloads) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(unknown)}: choose from {list(WORKLOADS)}")
    if ns.tensor_parallel_size < 1:
        ap.error(f"--tensor-parallel-size must be >= 1; got {ns.tensor_parallel_size}")
    model = ns.model or ROOT / "benchmarks" / "configs" / ns.config
    engine, seconds = start(model, ns.weights, ns.kv_cache_dtype, ns.tensor_parallel_size)
    for name in ns.workloads or ["throughput", "latency"]:
        run(engine, seconds, ns.config, name, ns.weights, ns.kv_cache_dtype, ns.tensor_parallel_size, model)
