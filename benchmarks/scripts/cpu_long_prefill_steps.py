"""How long each CPU step of one 8,100-token prefill takes, for the old default token
budget (2048), 512 alone, and 512 with chunks that shrink as the context grows
(attention_parity_len): the longest step is what an abort or another stream waits for.

    python benchmarks/scripts/cpu_long_prefill_steps.py
"""

import time

from ember import LLM, SamplingParams

for budget, parity in ((2048, False), (512, False), (512, True)):
    llm = LLM(dtype="float32", max_num_batched_tokens=budget)
    if not parity:
        llm.engine.scheduler.attention_parity_len = None
    engine = llm.engine
    req = llm._make_request({"prompt_token_ids": [504 + (i % 1000) for i in range(8100)]},
                            SamplingParams(max_tokens=1, temperature=0))
    engine.add_request(req)
    llm.processor.add_request(req)
    steps, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    llm.processor.abort(req.request_id)
    print(f"budget {budget} parity {parity}: {len(steps)} steps, total {time.perf_counter() - start:.1f} s, "
          f"first {steps[0]:.2f} s, longest {max(steps):.2f} s", flush=True)
    del llm, engine
