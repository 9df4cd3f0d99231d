"""The prefix cache's own CPU time on a workload with nothing to hit: every call into the
radix tree (match, insert, evict) is timed, against the wall time of the whole run.
`.venv/bin/python benchmarks/scripts/prefix_cache_overhead.py [NUM_KV_BLOCKS]`: with a small
pool (e.g. 256 blocks) a first untimed run fills it with cached blocks, so the timed run
evicts on almost every allocation (a long-running server's steady state)."""

import sys
import time

from ember import LLM, SamplingParams
from ember.bench.throughput import random_requests
from ember.scheduler.prefix_cache import RadixPrefixCache

spent = {"match": 0.0, "insert": 0.0, "evict": 0.0, "calls": 0}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
            spent["calls"] += 1
    return wrapper


for name in ("match", "insert", "evict"):
    setattr(RadixPrefixCache, name, timed(name, getattr(RadixPrefixCache, name)))

num_kv_blocks = int(sys.argv[1]) if len(sys.argv) > 1 else None
llm = LLM(dtype="bfloat16", num_kv_blocks=num_kv_blocks)
tok = llm.get_tokenizer()
requests = random_requests(16, 64, 128, 0.0, tok.vocab_size, tok.all_special_ids, 0)
params = [SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
llm.generate([{"prompt_token_ids": requests[0].prompt_token_ids[:4]}], SamplingParams(max_tokens=2))
if num_kv_blocks:  # fill the pool with cached blocks of other prompts first
    others = random_requests(16, 64, 128, 0.0, tok.vocab_size, tok.all_special_ids, 1)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in others], params)
for k in ("match", "insert", "evict"):
    spent[k] = 0.0
spent["calls"] = 0
start = time.perf_counter()
llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params)
wall = time.perf_counter() - start
cache = spent["match"] + spent["insert"] + spent["evict"]
print(f"evictable blocks left: {llm.engine.block_pool.num_evictable}; wall {wall:.2f} s; prefix cache {1e3 * cache:.2f} ms in {spent['calls']} calls "
      f"(match {1e3 * spent['match']:.2f}, insert {1e3 * spent['insert']:.2f}, evict {1e3 * spent['evict']:.2f}) "
      f"= {100 * cache / wall:.3f} % of the run")
