"""What a verifying step costs against a plain decode step, one request: the same prompt decoded
without speculation, then with K drafts a step that are always wrong (each step verifies K + 1
tokens and keeps one: the step's cost over a decode step's is the time per token's ratio), then
always right (each step keeps K + 1: the most speculation can give). The drafts come from an
oracle that reads the plain run's tokens, so dummy weights do (the Llama-8B shape on the GPU).
With --eagle3, a third engine drafts with an EAGLE-3 head of random weights at the target's shapes
(ember.bench.dummy_eagle3; its drafts about never accepted): a step's cost with the head's K
forwards and the verify, over a decode step's.

    python benchmarks/scripts/spec_verify_cost.py [MODEL] [--load-format dummy] [--k 4] [--input-len 128]
        [--output-len 512] [--eagle3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ember import LLM, SamplingParams
from ember.spec_decode.proposer import Proposer


class Oracle(Proposer):
    """The next k tokens of a known sequence (`shift`: each one off by one, never the model's)."""

    def __init__(self, sequence: list[int], shift: int) -> None:
        self.sequence, self.shift = sequence, shift

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        return [t + self.shift for t in self.sequence[len(token_ids): len(token_ids) + (k or 4)]]


def eagle3_run(args, common: dict, plain: LLM, prompt: dict, params: SamplingParams, base: float) -> dict:
    """One request drafted by a random EAGLE-3 head at the target's shapes: its step's cost."""
    import tempfile

    from ember.bench.dummy_eagle3 import write_head_for

    mc = plain.config.model_config
    target = {"hidden_size": mc.hidden_size, "vocab_size": mc.vocab_size, "num_attention_heads": mc.num_heads,
              "num_key_value_heads": mc.num_kv_heads, "intermediate_size": mc.intermediate_size,
              "head_dim": mc.head_dim}
    head = write_head_for(target, Path(tempfile.mkdtemp()) / "eagle3-head")
    llm = LLM(args.model, speculative_config={"method": "eagle3", "model": str(head),
                                              "num_speculative_tokens": args.k}, **common)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(prompt, params)
    took = time.perf_counter() - start
    counts = llm.engine.scheduler.spec
    return {"seconds": round(took, 3), "tok_per_s": round(args.output_len / took, 2),
            "step_over_decode_step": round(took / base, 3), "accepted": counts.num_accepted_tokens,
            "drafts": counts.num_draft_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0,
                    help="each engine's KV pool on a GPU (they share it, so each gets a fixed size)")
    ap.add_argument("--eagle3", action="store_true", help="also time an EAGLE-3 head of random weights")
    ap.add_argument("--output-json", default=os.path.join(os.environ.get("OUT", "/tmp"), "spec_verify_cost.json"))
    args = ap.parse_args()
    common = dict(load_format=args.load_format, seed=0, enable_prefix_caching=False, max_model_len=args.max_model_len)
    import torch

    if torch.cuda.is_available():
        common["kv_cache_memory"] = int(args.kv_cache_gib * 2**30)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config={"num_speculative_tokens": args.k}, **common)
    prompt = {"prompt_token_ids": [100 + i % 1000 for i in range(args.input_len)]}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def timed(llm: LLM) -> tuple[float, list[int]]:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        return time.perf_counter() - start, list(out.prompt_token_ids) + list(out.outputs[0].token_ids)

    base, sequence = timed(plain)
    result = {"model": str(plain.config.model), "device": plain.config.device, "k": args.k,
              "input_len": args.input_len, "output_len": args.output_len, "plain_ms_per_token": 1e3 * base /
              args.output_len}
    for name, shift in (("always_wrong", 1), ("always_right", 0)):
        spec.engine.proposer = Oracle(sequence, shift)
        took, got = timed(spec)
        # on the CPU's batch-invariant path the tokens are the plain run's; a GPU's verify and decode
        # kernels round differently, and dummy weights' logits are near ties, so they may part
        same = next((i for i, (a, b) in enumerate(zip(got, sequence)) if a != b), len(sequence))
        counts = spec.engine.scheduler.spec
        result[name] = {"seconds": round(took, 3), "tok_per_s": round(args.output_len / took, 2),
                        "vs_plain": round(base / took, 3), "steps": counts.num_drafts,
                        "same_tokens_as_plain": same - len(prompt["prompt_token_ids"])}
    steps_wrong = args.output_len - 1  # one token a step after the first
    result["verify_step_over_decode_step"] = round(result["always_wrong"]["seconds"] / base, 3)
    if args.eagle3:
        result["eagle3_random_head"] = eagle3_run(args, common, plain, prompt, params, base)
    print(json.dumps(result, indent=1))
    print(f"one verify step of {args.k + 1} tokens = {result['verify_step_over_decode_step']}x one decode step "
          f"({steps_wrong} steps each); always-right drafts: {result['always_right']['vs_plain']}x the plain rate"
          + (f"; with a random EAGLE-3 head's {args.k} drafts: {result['eagle3_random_head']['step_over_decode_step']}x"
             if args.eagle3 else ""))
    Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
