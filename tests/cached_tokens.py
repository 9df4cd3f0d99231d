"""How many prompt tokens the prefix cache should give a request: the tests that check
`num_cached_tokens` against what ran before share this."""

from __future__ import annotations


def kv_tokens(out) -> list[int]:
    """The tokens a finished request left KV for: its prompt and every output token but the
    last (sampled, never fed back)."""
    return out.prompt_token_ids + out.outputs[0].token_ids[:-1]


def expected_cached(prompt: list[int], earlier: list[list[int]]) -> int:
    """The longest prefix `prompt` shares with any of `earlier` (kv_tokens of requests that
    finished before it, nothing evicted since), leaving its last token to compute."""
    best = 0
    for seen in earlier:
        n = 0
        while n < min(len(seen), len(prompt)) and seen[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1)
