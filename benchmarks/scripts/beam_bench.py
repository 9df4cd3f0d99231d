"""ember's `LLM.beam_search` on the prompts vllm_race.py's `beam` workload gives vLLM's
`LLM.beam_search` (issue #40: >= 1.5x vLLM's tokens/s): width 4, 64 prompts of 128 random token ids
(random_requests, seed 0, over the model's vocab_size: config.json's, which vllm_race.py reads),
128 tokens each, ignore_eos; the engine at vllm_race.py's limits (max_model_len 2048, 512 seats,
16384 tokens a step). One tiny beam search warms up; the timed call is the whole list at once.

    python3 benchmarks/scripts/beam_bench.py MODEL [--num-prompts 64] [--input-len 128] [--output-len 128]
        [--beam-width 4] [--load-format dummy] [--dtype auto] [--output-json FILE] [--profile FILE]

Throughput as vLLM's `vllm bench throughput` counts a beam run (prompts x max_tokens / s:
output_tok_s) and as the returned sequences' generated tokens / s (sequence_tok_s, beam_width
times more with ignore_eos); vllm_race.py prints both the same way. One RESULT line (JSON);
--output-json adds every returned sequence's token ids. --profile runs the search once more under
cProfile and writes where the host's time goes (cumulative, then own time) to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

from vllm_race import LIMITS, WORKLOADS

from ember import LLM, BeamSearchParams
from ember.bench.throughput import random_requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model directory (the served model: vLLM's beam search needs its tokenizer) or file")
    beam = WORKLOADS["beam"]
    ap.add_argument("--num-prompts", type=int, default=beam["num_prompts"])
    ap.add_argument("--input-len", type=int, default=beam["input_len"])
    ap.add_argument("--output-len", type=int, default=beam["output_len"])
    ap.add_argument("--beam-width", type=int, default=beam["beam_width"])
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--output-json", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.time()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, seed=0, **LIMITS)
    startup = time.time() - t0
    vocab = llm.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": r.prompt_token_ids}
               for r in random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, [], seed=0)]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": [1, 2, 3, 4]}],
                    BeamSearchParams(beam_width=args.beam_width, max_tokens=2, ignore_eos=True))
    t = time.time()
    outs = llm.beam_search(prompts, params)
    dt = time.time() - t
    generated = sum(len(s.tokens) - args.input_len for o in outs for s in o.sequences)
    result = dict(engine="ember", model=args.model, workload=f"beam: {args.num_prompts} x {args.input_len}/"
                  f"{args.output_len}, width {args.beam_width}", startup_s=round(startup, 1), seconds=round(dt, 2),
                  output_tok_s=round(args.num_prompts * args.output_len / dt, 1),
                  sequence_tokens=generated, sequence_tok_s=round(generated / dt, 1))
    print("RESULT", json.dumps(result), flush=True)
    if args.output_json:
        sequences = [[s.tokens for s in o.sequences] for o in outs]
        args.output_json.write_text(json.dumps(result | {"sequences": sequences}) + "\n")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(llm.beam_search, prompts, params)
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        args.profile.write_text(text.getvalue())


if __name__ == "__main__":
    main()
