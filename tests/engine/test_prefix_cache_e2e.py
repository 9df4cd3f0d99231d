"""The prefix cache on the real model: the same tokens with the cache on and off, and
cached-token counts equal to what a plain longest-common-prefix computation expects.

A token has KV once the model has run on it: every prompt token, and every output token
but the last (sampled, never fed back). A later prompt reuses the longest prefix it shares
with that, to the token (whole 16-token blocks, then a copy of the cached block it ends in),
and always computes its own last token.
"""

import pytest
from cached_tokens import expected_cached, kv_tokens

from ember import SamplingParams

SYSTEM = ("You are a careful assistant for a small library. You answer questions about opening hours, "
          "borrowing rules and the reading room in two short sentences. ") * 3
QUESTIONS = ["When do you open on Monday?", "How many books can I borrow?", "Is there wifi in the reading room?",
             "Can I renew a loan online?", "Do you have a printer?", "Are dogs allowed inside?"]
BLOCK = 16


@pytest.fixture(scope="module")
def cache_on(extra_llm):
    return extra_llm(enable_prefix_caching=True)


@pytest.fixture(scope="module")
def cache_off(extra_llm):
    return extra_llm(enable_prefix_caching=False)


def test_shared_prefix_batches_give_the_same_tokens_with_the_cache_on_and_off(cache_on, cache_off):
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = [f"{SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    first = cache_on.generate(prompts[:3], params)  # the others wait a step for the first's shared blocks
    second = cache_on.generate(prompts, params)
    off = cache_off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in off[:3]]
    assert [o.num_cached_tokens for o in first] == \
        [0] + [expected_cached(o.prompt_token_ids, [first[0].prompt_token_ids]) for o in first[1:]]
    assert first[1].num_cached_tokens >= 64, "the system prompt is computed once"
    seen = [kv_tokens(o) for o in first]
    cached = [o.num_cached_tokens for o in second]
    assert cached == [expected_cached(o.prompt_token_ids, seen) for o in second]
    assert cached[0] == len(second[0].prompt_token_ids) - 1  # an exact repeat: all but its last token
    assert min(cached[3:]) >= 64, "the shared system prompt is reused"
    assert all(o.num_cached_tokens == 0 for o in off)


def test_a_multi_turn_chat_reuses_its_history_with_the_same_answers(cache_on, cache_off):
    params = SamplingParams(temperature=0, max_tokens=24)
    conversation = [{"role": "system", "content": "You are a concise assistant."}]
    seen: list[list[int]] = []
    for question in ["Name a large city in France.", "What river runs through it?", "Name one bridge over it."]:
        conversation.append({"role": "user", "content": question})
        on = cache_on.chat(conversation, params)[0]
        off = cache_off.chat(conversation, params)[0]
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        assert on.num_cached_tokens == expected_cached(on.prompt_token_ids, seen)
        if seen:
            assert on.num_cached_tokens >= len(seen[-1]) - 2 * BLOCK, "most of the last turn is reused"
        seen.append(kv_tokens(on))
        conversation.append({"role": "assistant", "content": on.outputs[0].text})


def test_prompt_logprobs_with_the_cache_on_equal_the_cache_off(cache_on, cache_off):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    prompt = f"{SYSTEM}\nQuestion: {QUESTIONS[0]}\nAnswer:"
    cache_on.generate(prompt, SamplingParams(temperature=0, max_tokens=2))  # warm the cache
    on, off = cache_on.generate(prompt, params)[0], cache_off.generate(prompt, params)[0]
    assert on.num_cached_tokens == 0, "prompt logprobs need every position: no cache read"
    assert [None if d is None else sorted(d) for d in on.prompt_logprobs] == \
        [None if d is None else sorted(d) for d in off.prompt_logprobs]
