"""The checks every family's CPU test makes against HF transformers on a tiny random model
(float32): one forward's logits, greedy tokens, and the same tokens through 5-token chunks of
prefill and then over the prefix cache. The second time a prompt (13, 1, 27 tokens) finds all but
its last token cached (12, 0, 26: whole 8-token blocks, then a copy of the block it ends in), or
only whole blocks (8, 0, 24) where a hit stops at a block's end (a recurrent state's snapshot)."""

from __future__ import annotations

import torch

from ember import LLM, SamplingParams

PROMPTS = [
    [5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3],
    [7],
    [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(num_kv_blocks=128, block_size=8, max_model_len=256, dtype="float32")
CACHED = [[0, 0, 0], [12, 0, 26]]  # each prompt's cached tokens, the first time and the second
WHOLE_BLOCKS = [[0, 0, 0], [8, 0, 24]]  # the same where hits end on block boundaries


def hf_greedy(hf, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_logits_match(llm, hf, prompts: list[list[int]], forward_logits) -> None:
    for ids, ours in zip(prompts, forward_logits(llm, prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def assert_matches_hf(llm, hf, forward_logits, greedy: list[list[int]] | None = None) -> None:
    """PROMPTS' logits within float32 rounding of transformers', and their greedy tokens
    (`greedy`: transformers' already made, else made here)."""
    assert_logits_match(llm, hf, PROMPTS, forward_logits)
    assert greedy_tokens(llm) == (greedy if greedy is not None else [hf_greedy(hf, ids) for ids in PROMPTS])


def greedy_tokens(llm, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def assert_chunked_and_cached(model: str, expected: list[list[int]], cached_tokens: list[list[int]] = CACHED,
                              **engine) -> LLM:
    """PROMPTS in 5-token chunks, then again over their cached prefix: the same greedy tokens
    both times, and `cached_tokens` from the cache each time. Returns the engine."""
    llm = LLM(model, **(ENGINE | engine | dict(max_num_batched_tokens=5)))
    cached = []
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        cached.append([o.num_cached_tokens for o in outs])
    assert cached == cached_tokens
    return llm
