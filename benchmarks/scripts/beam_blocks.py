"""Beam search's KV blocks: the most blocks in use at any step of LLM.beam_search (a beam that
continues another shares its full blocks and copies its last, partly filled one: engine/
beam_groups.py) against k unshared copies of the best sequence, the tokens the model ran (a
beam computes one token a step), and the wall time, for k = 1, 2, 4, 8 on two prompts of the
default model (CPU).

    python benchmarks/scripts/beam_blocks.py [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import time

from ember import LLM, BeamSearchParams

PROMPTS = ["Explain why the sky is blue in one paragraph. " * 4, "Write a haiku about the sea and the wind and the moon."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    llm = LLM(None)
    core, peak, computed = llm.engine, [0], [0]
    launch = core.runner.launch

    def counted(plan, *a, **kw):  # blocks held while each step runs, tokens it computes
        peak[0] = max(peak[0], core.block_pool.num_in_use)
        computed[0] += plan.num_tokens
        return launch(plan, *a, **kw)

    core.runner.launch = counted
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    bs = llm.config.block_size
    for k in (1, 2, 4, 8):
        peak[0] = computed[0] = 0
        start = time.perf_counter()
        outs = llm.beam_search([{"prompt_token_ids": i} for i in ids],
                               BeamSearchParams(beam_width=k, max_tokens=args.max_tokens, ignore_eos=True))
        took = time.perf_counter() - start
        unshared = sum(k * -(-len(o.sequences[0].tokens) // bs) for o in outs)
        print(f"k={k}: at most {peak[0]} blocks in use; k unshared copies: {unshared} ({peak[0] / unshared:.2f}x); "
              f"{computed[0]} tokens computed; {took:.1f} s")


if __name__ == "__main__":
    main()
