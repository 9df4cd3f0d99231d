"""Decode tok/s of the default model at its defaults (CPU), decode steps alone (the prompts
prefilled first, then 100 steps timed): `python3 cpu_decode_ab.py TREE`, TREE the repo whose
ember is imported (a worktree of the commit before, then this one, alternating)."""
import sys
import time

sys.path.insert(0, sys.argv[1])
from ember import LLM, SamplingParams
from ember.loader.default_model import default_model_path
from ember.request import Request

llm = LLM(str(default_model_path()))
tok = llm.get_tokenizer()
ids = tok.encode("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a screw press. " * 200)
def decode_rate(batch, ctx, steps=100):
    core = llm.engine
    reqs = [Request(f"r{batch}-{i}", ids[i*7:i*7+ctx], SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)) for i in range(batch)]
    for r in reqs: core.add_request(r)
    while any(len(r.output_token_ids) == 0 for r in reqs): core.step()
    t = time.perf_counter()
    for _ in range(steps): core.step()
    dt = time.perf_counter() - t
    for r in reqs: core.abort_request(r.request_id)
    return batch * steps / dt
for b, c in [(16, 500), (1, 1000), (64, 300)]:
    print(f"decode {b} x {c}: {decode_rate(b, c):.1f} tok/s", end="; ")
print()
