"""Batch invariance with the real SmolLM2 model (float32, CPU, greedy, ignore_eos): a
request's output token ids do not depend on what else shares its steps, on how its prompt
is chunked, on being preempted and recomputed, or on other requests being aborted.

When two runs differ, the assertion message names the first differing position and the
top-2 logit gap there (from one plain forward of prompt + common prefix), so that a float
near-tie can be told from a real bug.
"""

from __future__ import annotations

import pytest
import torch
from sampling import greedy

from ember import LLM
from ember.request import Request

pytestmark = pytest.mark.slow  # loads the real model three times (session + 2 small pools)

MAX_TOKENS = 24

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. In plants, photosynthesis generally "
    "involves the green pigment chlorophyll and",
    "The following is a list of the planets of the solar system, in order of their distance from "
    "the Sun, with a short note on each. Mercury is the smallest planet and the closest to the "
    "Sun; a year there lasts only 88 days. Venus is the hottest planet, wrapped in thick clouds "
    "of sulfuric acid. Earth is the only planet known to harbor life. Mars, the red planet, has "
    "the tallest volcano in the solar system. Jupiter",
]

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined a screw press with movable metal type, oil-based ink and paper. "
    "Books became cheaper, literacy spread, and ideas travelled faster across Europe than "
    "ever before. "
)

# ~40-token prompts (37 to 42) for the tiny pool
FORTY = [
    "Write a short story about a robot who learns to paint. The robot lives in a quiet city "
    "by the sea, and every single morning it stands on the pier and watches the old fishing boats leave the harbor while",
    "List five reasons why people enjoy hiking in the mountains during the long summer months, and "
    "explain for each one of them why it matters so much to beginners who have never been on a trail",
    "In mathematics, a prime number is a natural number greater than one that has no positive "
    "divisors other than one and itself. The first few prime numbers, in increasing order, are two, three, five,",
    "The recipe for a simple tomato soup needs ripe tomatoes, an onion, two cloves of garlic, "
    "olive oil, salt, pepper and a little fresh basil. First, peel and finely chop the onion and",
    "Dear hiring manager, I am writing to apply for the position of junior software engineer "
    "at your company. During my four years of studies at the university I built several projects in Python, including",
    "The ocean covers about seventy percent of the surface of the Earth and holds most of its "
    "water. Scientists usually divide it into five large basins: the Pacific, the Atlantic, the Indian, the",
]


@pytest.fixture(scope="module")
def chunked_llm(extra_llm):
    """A 128-token step budget: a 1000-token prompt is prefilled in 8 chunks."""
    return extra_llm(max_num_batched_tokens=128, num_kv_blocks=80, block_size=16)


@pytest.fixture(scope="module")
def one_step_llm(extra_llm):
    """A 2048-token step budget: a 1000-token prompt is prefilled in one step."""
    return extra_llm(max_num_batched_tokens=2048, num_kv_blocks=80, block_size=16)


@pytest.fixture(scope="module")
def tiny_llm(extra_llm):
    """12 blocks of 16 tokens: six 40+40-token requests (5 blocks each at the end) must preempt."""
    return extra_llm(num_kv_blocks=12, block_size=16)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def explain(llm: LLM, prompt_ids: list[int], got: list[int], want: list[int], forward_logits) -> str:
    """Where two outputs part and how close the reference's top two logits were there."""
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if k >= min(len(got), len(want)):
        return f"lengths differ: {len(got)} vs {len(want)}"
    logits = forward_logits(llm, [prompt_ids + want[:k]])[0][-1]
    top = torch.topk(logits, 2)
    return (f"first difference at output position {k} (of {len(want)}), prompt of {len(prompt_ids)} tokens: "
            f"got {got[k]}, want {want[k]}; reference top-2 {top.indices.tolist()} with logits "
            f"{[round(v, 5) for v in top.values.tolist()]}, gap {float(top.values[0] - top.values[1]):.6f}; "
            f"logit of got token {float(logits[got[k]]):.5f}")


def assert_same(llm, prompts_ids, got, want, forward_logits) -> None:
    for i, (p, g, w) in enumerate(zip(prompts_ids, got, want)):
        assert g == w, f"prompt {i}: " + explain(llm, p, g, w, forward_logits)


# ---- together == alone -------------------------------------------------------------------

@pytest.fixture(scope="module")
def alone(llm):
    """Each of PROMPTS generated on its own: the reference."""
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, [llm.generate({"prompt_token_ids": p}, greedy(MAX_TOKENS, ignore_eos=True))[0].outputs[0].token_ids
                 for p in ids]


def test_prompts_have_different_lengths(alone):
    ids, outs = alone
    lengths = [len(p) for p in ids]
    assert len(set(lengths)) == len(PROMPTS)
    assert min(lengths) <= 2 and max(lengths) >= 90
    assert all(len(o) == MAX_TOKENS for o in outs)


def test_together_equals_alone(llm, alone, forward_logits):
    ids, want = alone
    got = token_ids(llm.generate([{"prompt_token_ids": p} for p in ids], greedy(MAX_TOKENS, ignore_eos=True)))
    assert_same(llm, ids, got, want, forward_logits)


# ---- chunked prefill == one-step prefill ---------------------------------------------------

@pytest.fixture(scope="module")
def long_prompt(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PARAGRAPH * 20)
    assert 900 <= len(ids) <= 1100 and len(ids) < llm.config.max_model_len
    return ids


def test_chunked_prefill_equals_one_step_prefill(llm, chunked_llm, one_step_llm, alone, long_prompt,
                                                forward_logits, monkeypatch):
    """The long prompt in chunks of at most 128 tokens, sharing every step with the decodes of
    two short requests, gives the same tokens as its prefill in one step (budget 2048) with
    nothing else."""
    assert one_step_llm.config.max_num_batched_tokens == 2048 > len(long_prompt)
    assert chunked_llm.config.max_num_batched_tokens == 128
    one_step = one_step_llm.generate({"prompt_token_ids": long_prompt},
                                     greedy(MAX_TOKENS, ignore_eos=True))[0].outputs[0].token_ids

    ids, want = alone
    engine = chunked_llm.engine
    short = [Request("short-a", ids[1], greedy(MAX_TOKENS, ignore_eos=True)),
             Request("short-b", ids[3], greedy(MAX_TOKENS, ignore_eos=True))]
    long = Request("long", long_prompt, greedy(MAX_TOKENS, ignore_eos=True))
    for r in [*short, long]:  # FCFS: the short ones first, so the long one's chunks share steps
        engine.add_request(r)
    plans = []  # every step's plan as [(request id, tokens, samples)], seen through a spy
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        plans.append([(c.request.request_id, c.num_new_tokens, c.samples) for c in plan.chunks])
        assert plan.num_tokens <= 128
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    while engine.has_unfinished_requests():
        engine.step()
    long_chunks = [(n, samples) for plan in plans for rid, n, samples in plan if rid == "long"]
    prefill = long_chunks[: 1 + [samples for _, samples in long_chunks].index(True)]
    chunks = [n for n, _ in prefill]
    assert sum(chunks) == len(long_prompt)
    # step 1: both short prompts, then the long one; then 126 a step next to 2 decodes, each
    # chunk at most 128 * L / (L + c) at context c (the CPU's attention_parity_len L)
    parity, want_chunks, done = chunked_llm.config.attention_parity_len, [], 0
    while done < len(long_prompt):
        room = 128 - len(ids[1]) - len(ids[3]) if not done else 126
        want_chunks.append(min(len(long_prompt) - done, room, 128 * parity // (parity + done)))
        done += want_chunks[-1]
    assert chunks == want_chunks
    assert len(chunks) >= 8 and min(chunks[:-1]) < 126  # the cap shrank the late chunks
    assert all(r.finish_reason == "length" for r in [*short, long])
    assert long.output_token_ids == one_step, explain(llm, long_prompt, long.output_token_ids, one_step,
                                                      forward_logits)
    assert_same(llm, [ids[1], ids[3]], [r.output_token_ids for r in short], [want[1], want[3]], forward_logits)


# ---- preemption and recompute ------------------------------------------------------------

def test_a_tiny_pool_preempts_and_every_request_matches_the_big_pool(llm, tiny_llm, forward_logits):
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in FORTY]
    assert all(36 <= len(p) <= 44 for p in ids), [len(p) for p in ids]
    # 6 x 3 blocks of prompt > 12: only 4 fit at first; each grows to 5 blocks (80 tokens)
    params = greedy(40, ignore_eos=True)
    want = token_ids(llm.generate([{"prompt_token_ids": p} for p in ids], params))

    before = tiny_llm.engine.scheduler.num_preemptions
    outs = tiny_llm.generate([{"prompt_token_ids": p} for p in ids], params)
    assert tiny_llm.engine.scheduler.num_preemptions > before
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert_same(llm, ids, token_ids(outs), want, forward_logits)


# ---- abort ---------------------------------------------------------------------------------

def test_abort_everything_mid_flight_then_serve_the_same_output(llm, alone):
    ids, want = alone
    engine = llm.engine
    reqs = [Request(f"to-abort-{i}", ids[i], greedy(50, ignore_eos=True)) for i in (2, 4, 5)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    assert engine.block_pool.num_in_use > 0
    for r in reqs:
        engine.abort_request(r.request_id)
    assert all(r.finish_reason == "abort" and r.block_ids == [] for r in reqs)
    llm.check_idle()
    # the engine serves on, with the same output (8 tokens: enough to see the KV is sound)
    assert token_ids(llm.generate({"prompt_token_ids": ids[4]}, greedy(8, ignore_eos=True))) == [want[4][:8]]
