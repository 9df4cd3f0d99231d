"""vLLM 0.24 with FP8 weights (quantization="fp8": its online per-tensor quantization of the
dummy bf16 weights) and an fp8 KV cache, on the requests `ember bench throughput` draws for
the same flags (ember/bench/throughput.py `random_requests`: the same token ids and lengths,
seed 0, no special ids since the config directory has no tokenizer), Llama-3.1-8B shape
(benchmarks/configs/llama-3.1-8b):

    llama     512 x 1000/1000, max_num_seqs 512, max_num_batched_tokens 16384, max_model_len 2048
    latency   one request, 128 in / 512 out

Sampling as ember's bench: temperature 1.0, top_p 1.0, ignore_eos, max_tokens = the
request's output length; only the generate call is timed, after a tiny warm-up. `--weights
bf16` runs the same without quantization (fp8 KV still). One RESULT line (JSON) a workload.
Run on the device with vLLM staged (/work/shared/peers/vllm-gpu/stage; h200_fp8.sh vllm):
`python3 benchmarks/scripts/vllm_fp8_bench.py [llama] [latency] [--weights bf16]`"""

import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # ember's random_requests, for the same prompts as ember's bench

CONFIG_DIR = ROOT / "benchmarks" / "configs" / "llama-3.1-8b"
WORKLOADS = {  # name: (ember bench flags as numbers, vLLM engine limits)
    "llama": (dict(num_prompts=512, input_len=1000, output_len=1000),
              dict(max_model_len=2048, max_num_seqs=512, max_num_batched_tokens=16384)),
    "latency": (dict(num_prompts=1, input_len=128, output_len=512), dict(max_model_len=2048)),
}


def requests(num_prompts: int, input_len: int, output_len: int):
    from ember.bench.throughput import random_requests

    vocab = json.loads((CONFIG_DIR / "config.json").read_text())["vocab_size"]
    return random_requests(num_prompts, input_len, output_len, 0.0, vocab, [], seed=0)


def run(name: str, weights: str) -> dict:
    from vllm import LLM, SamplingParams

    shape, limits = WORKLOADS[name]
    reqs = requests(**shape)
    quant = {"quantization": "fp8"} if weights == "fp8" else {}
    t0 = time.time()
    llm = LLM(model=str(CONFIG_DIR), load_format="dummy", skip_tokenizer_init=True, gpu_memory_utilization=0.9,
              seed=0, kv_cache_dtype="fp8", **quant, **limits)
    startup = time.time() - t0
    llm.generate([{"prompt_token_ids": reqs[0].prompt_token_ids[:4]}], SamplingParams(max_tokens=2, detokenize=False),
                 use_tqdm=False)
    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len,
                             detokenize=False) for r in reqs]
    t = time.time()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    dt = time.time() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    result = dict(workload=f"{name}: {shape['num_prompts']} x {shape['input_len']}/{shape['output_len']}",
                  weights=weights, kv_cache_dtype="fp8", startup_s=round(startup, 1), seconds=round(dt, 2),
                  prompt_tokens=prompt_tokens, output_tokens=out_tokens, output_tok_s=round(out_tokens / dt, 1),
                  total_tok_s=round((prompt_tokens + out_tokens) / dt, 1))
    print("RESULT", json.dumps(result), flush=True)
    del llm
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    weights = "bf16" if "--weights" in args and args[args.index("--weights") + 1] == "bf16" else "fp8"
    for name in [a for a in args if a in WORKLOADS] or list(WORKLOADS):
        run(name, weights)
