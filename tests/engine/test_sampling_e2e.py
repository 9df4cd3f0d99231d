"""Sampling features end to end on the real model: n > 1 forks sharing prompt blocks,
logprobs and prompt logprobs against HF, seeded reproducibility, bad words of several tokens."""

import torch

from ember import SamplingParams
from ember.request import Request

PROMPT = "The history of the Roman Empire is long and complicated, and historians"


def test_n_samples_share_the_prompt_blocks(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT * 3)  # several full blocks and a partial one
    core, pool = llm.engine, llm.engine.block_pool
    bs = llm.config.block_size
    full, partial = divmod(len(ids), bs)
    assert partial, "the prompt must end inside a block"
    in_use_before = pool.num_in_use
    req = Request("fork", ids, SamplingParams(n=4, temperature=0, max_tokens=6, ignore_eos=True))
    core.add_request(req)
    core.step()  # prefill, 4 first tokens, fork
    try:
        kids = [core.scheduler.requests[f"fork#{i}"] for i in (1, 2, 3)]
        for kid in kids:
            assert kid.block_ids[:full] == req.block_ids[:full]
            assert kid.block_ids[full] != req.block_ids[full]
        for b in req.block_ids[:full]:
            assert pool.ref_counts[b] == 4
        assert len({k.block_ids[full] for k in kids} | {req.block_ids[full]}) == 4
        assert pool.num_in_use - in_use_before == full + 4
        pool.check_integrity()
    finally:
        core.abort_request("fork")
    assert pool.num_in_use == in_use_before


def test_n_greedy_samples_equal_one_greedy_sample(llm):
    one = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    four = llm.generate(PROMPT, SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in four.outputs] == [0, 1, 2, 3]
    for c in four.outputs:
        assert c.token_ids == one.outputs[0].token_ids
        assert c.text == one.outputs[0].text


def test_seeded_sample_i_equals_a_request_seeded_seed_plus_i(llm):
    params = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    four = llm.generate(PROMPT, SamplingParams(n=4, seed=100, **params))[0]
    singles = llm.generate([PROMPT] * 4, [SamplingParams(seed=100 + i, **params) for i in range(4)])
    assert [c.token_ids for c in four.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in four.outputs}) > 1


def test_seeded_request_is_the_same_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    others = ["Hello", "def f(x):", "A long time ago in a galaxy far, far away"]
    batch = llm.generate(others + [PROMPT], [SamplingParams(temperature=1.0, max_tokens=16)] * 3 + [seeded])
    assert batch[3].outputs[0].token_ids == alone


def test_logprobs_equal_hf_log_softmax(llm, hf_model):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True))[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    total = 0.0
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[n - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the top token
        top = row.topk(3)
        assert list(entry)[:1] == [token] and set(entry) == set(top.indices.tolist())
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4
        total += entry[token].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-6


def test_prompt_logprobs_equal_hf(llm, hf_model):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        assert len(entry) in (2, 3)  # the prompt token plus the top 2 (it may be one of them)


def test_a_bad_word_of_several_tokens_is_cut_at_its_last(llm):
    tok = llm.get_tokenizer()
    free = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    words = tok.decode(free.token_ids[:2])  # " Paris." as two tokens: ban the pair, not either token
    params = SamplingParams(temperature=0, max_tokens=8, bad_words=[words])
    out = llm.generate("The capital of France is", params)[0].outputs[0]
    assert params.bad_words_token_ids == [tok.encode("Paris.", add_special_tokens=False), free.token_ids[:2]]
    assert out.token_ids[0] == free.token_ids[0] and out.token_ids[1] != free.token_ids[1]
    assert out.token_ids[:2] != free.token_ids[:2]
