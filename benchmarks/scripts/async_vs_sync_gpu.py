"""Async vs synchronous scheduling on CUDA (dummy Qwen3-0.6B weights): the same tokens?

    python3 benchmarks/scripts/async_vs_sync_gpu.py 0 sync.json
    python3 benchmarks/scripts/async_vs_sync_gpu.py 1 async.json
    python3 benchmarks/scripts/async_vs_sync_gpu.py compare sync.json async.json

48 requests of random ids (5-300 tokens, 1-80 new): greedy, seeded top-p and greedy with
EOS, prefix caching on; then an all-greedy batch, and a stream closed after 3 tokens.
"""

import json
import random
import sys


def run(async_scheduling: bool, out: str) -> None:
    from ember import LLM, SamplingParams

    rng = random.Random(0)
    n = 48
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(rng.randrange(5, 300))]}
               for _ in range(n)]
    params = []
    for i in range(n):
        m = rng.randrange(1, 80)
        params.append([SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                       SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=m, ignore_eos=True),
                       SamplingParams(temperature=0, max_tokens=m)][i % 3])
    llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", max_model_len=1024, max_num_seqs=64,
              gpu_memory_utilization=0.3, async_scheduling=async_scheduling, seed=0)
    greedy = llm.generate(prompts[::3], params[::3])
    mixed = llm.generate(prompts, params)
    stream = llm.stream(prompts[5], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    first = [next(stream).outputs[0].token_ids for _ in range(3)]
    stream.close()
    llm.check_idle()
    json.dump({"greedy": [o.outputs[0].token_ids for o in greedy], "mixed": [o.outputs[0].token_ids for o in mixed],
               "stream": first}, open(out, "w"))


def compare(a_path: str, b_path: str) -> None:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    for key in a:
        differ = [i for i, (x, y) in enumerate(zip(a[key], b[key])) if x != y]
        print(f"{key}: {len(a[key]) - len(differ)}/{len(a[key])} identical", differ or "")


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1] == "1", sys.argv[2])
