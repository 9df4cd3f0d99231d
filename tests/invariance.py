"""Batch invariance of a whole engine, for the model tests: a model's greedy tokens and their
logprobs (the logits' bits) for each prompt alone equal those in a mixed batch, with chunked
prefill at small budgets, after a prefix-cache hit and after preemption."""

from __future__ import annotations

from pathlib import Path

from ember import LLM, SamplingParams


def prompts_with_a_shared_prefix(vocab: int, count: int = 4, prefix: int = 40, suffix: int = 9) -> list[list[int]]:
    """`count` prompts of token ids (3 .. vocab - 1): one shared `prefix`, then their own."""
    ids = lambda start, n: [3 + (start + 7 * i) % (vocab - 3) for i in range(n)]  # noqa: E731
    shared = ids(0, prefix)
    return [shared + ids(101 * (k + 1), suffix + 3 * k) for k in range(count)]


def results(outs) -> list[tuple[list[int], list[float]]]:
    """Each output's tokens and their logprobs (asked with logprobs=0), as floats: equal only
    if the logits' bits are."""
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


def outputs(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return results(llm.generate([{"prompt_token_ids": p} for p in prompts], params))


def assert_same(got, want, case: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] == w[0], f"{case}: prompt {i}'s tokens differ"
        assert g[1] == w[1], f"{case}: prompt {i}'s logprobs differ (same tokens, other logits)"


def assert_batch_invariant(model: Path, prompts: list[list[int]], max_tokens: int = 16, block_size: int = 8,
                           **engine_args) -> LLM:
    """Each case against every prompt alone (prefix cache off); the message names the case.
    Returns the reference engine."""
    def make(**args) -> LLM:
        return LLM(str(model), block_size=block_size, max_model_len=256, **(engine_args | args))

    reference = make(enable_prefix_caching=False)
    alone = [outputs(reference, [p], max_tokens)[0] for p in prompts]
    cases = {"together": outputs(reference, prompts, max_tokens)}
    for budget in (7, 19):
        cases[f"chunked at {budget} tokens a step"] = outputs(
            make(max_num_batched_tokens=budget, enable_prefix_caching=False), prompts, max_tokens)
    cached = make()
    outputs(cached, [prompts[0][:-2]], 2)  # warms the shared prefix's blocks
    cases["after a prefix-cache hit"] = outputs(cached, prompts, max_tokens)
    small = make(num_kv_blocks=-(-max(len(p) for p in prompts) // block_size) + 4 + max_tokens // block_size,
                 enable_prefix_caching=False)
    cases["preempted in a small pool"] = outputs(small, prompts, max_tokens)
    assert small.engine.scheduler.num_preemptions > 0
    for case, got in cases.items():
        assert_same(got, alone, case)
    return reference
