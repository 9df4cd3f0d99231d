"""Prompt-lookup speculative decoding against none, one request at a time, on the input-grounded
prompts of benchmarks/spec_ngram_prompts.json (rewrite / rename / restyle / proofread a text or
code given in the prompt, built from the Python standard library's sources): output tokens per
second of each engine (one request at a time, or --batch copies at once), end to end and after
the first token (the time of a max_tokens=1 run of
the same prompt taken off: the prefix cache is off), the mean accepted length, and whether every
greedy output is the same. The engines alternate prompt by prompt, so a slower spell of the
machine hits both.

    python benchmarks/scripts/spec_ngram.py [--model M] [--max-tokens 128] [--k 4] [--lookup 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ember import LLM, SamplingParams

PROMPTS = Path(__file__).resolve().parents[1] / "spec_ngram_prompts.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens values to race")
    ap.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (the first warms up)")
    ap.add_argument("--batch", type=int, default=1, help="requests at once: each prompt this many times (copies "
                                                          "of a prompt decode alike: the batch's cost, not its mix)")
    ap.add_argument("--output-json", default=os.path.join(os.environ.get("OUT", "/tmp"), "spec_ngram.json"))
    args = ap.parse_args()
    items = json.loads(PROMPTS.read_text())
    engines = {"none": LLM(args.model, enable_prefix_caching=False)}
    for k in args.k:
        engines[f"ngram k={k}"] = LLM(args.model, enable_prefix_caching=False, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.lookup[0],
            "prompt_lookup_max": args.lookup[1]})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    first = SamplingParams(temperature=0, max_tokens=1)
    seconds = dict.fromkeys(engines, 0.0)
    prefill = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        for item in items:
            for name, llm in engines.items():
                batch = [item["messages"]] * args.batch
                start = time.perf_counter()
                llm.chat(batch, first)
                to_first = time.perf_counter() - start
                start = time.perf_counter()
                outs = [o.outputs[0] for o in llm.chat(batch, params)]
                took = time.perf_counter() - start
                if rep == args.repeats - 1 or args.repeats == 1:
                    seconds[name] += took
                    prefill[name] += to_first
                    tokens[name] += sum(len(o.token_ids) for o in outs)
                    outputs[name] += [list(o.token_ids) for o in outs]
    result = {"model": str(engines["none"].config.model), "device": engines["none"].config.device,
              "prompts": len(items), "batch": args.batch, "max_tokens": args.max_tokens, "lookup": args.lookup,
              "engines": {}}
    for name, llm in engines.items():
        rate = tokens[name] / seconds[name]
        decode = (tokens[name] - len(outputs[name])) / (seconds[name] - prefill[name])
        none_decode = (tokens["none"] - len(outputs["none"])) / (seconds["none"] - prefill["none"])
        row = {"output_tokens": tokens[name], "seconds": round(seconds[name], 3), "tok_per_s": round(rate, 2),
               "speedup": round(rate / (tokens["none"] / seconds["none"]), 3),
               "decode_tok_per_s": round(decode, 2), "decode_speedup": round(decode / none_decode, 3),
               "same_tokens": outputs[name] == outputs["none"]}
        spec = llm.engine.scheduler.spec
        if spec.num_drafts:
            row["mean_accepted_length"] = round(1 + spec.num_accepted_tokens / spec.num_drafts, 3)
            row["acceptance_rate"] = round(spec.num_accepted_tokens / spec.num_draft_tokens, 3)
        result["engines"][name] = row
        print(f"{name:12s} {rate:8.2f} tok/s  x{row['speedup']:.2f}  after the first token {decode:8.2f} tok/s "
              f"x{row['decode_speedup']:.2f}  same tokens: {row['same_tokens']}"
              + (f"  mean accepted length {row['mean_accepted_length']}" if spec.num_drafts else ""))
    Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
