"""Each sampling parameter against a plain reference computation, on synthetic logits."""

import math

import pytest
import torch

from ember.runner.sampler import Sampler, SamplingRow, _processed, edits_logits
from ember.sampling_params import SamplingParams

VOCAB = 12


def row(params: SamplingParams, prompt=(1, 2), output=(), eos=frozenset({0}), generator=None) -> SamplingRow:
    return SamplingRow(params, generator, list(prompt), list(output), eos)


def logits(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


L = [0.5, 2.0, -1.0, 3.0, 0.0, 1.5, -2.0, 2.5, 0.1, -0.5, 1.0, 2.9]


def test_greedy_is_argmax():
    # reversed L: index i holds L[11 - i]; its max 3.0 sits at 11 - 3 = 8
    out = Sampler(0)(logits(L, L[::-1]), [row(SamplingParams(temperature=0))] * 2)
    assert out.token_ids == [3, 8]


def test_top_k_one_is_greedy_whatever_the_temperature():
    rows = [row(SamplingParams(temperature=5.0, top_k=1, seed=s)) for s in range(8)]
    assert Sampler(0)(logits(*[L] * 8), rows).token_ids == [3] * 8


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = torch.tensor(L).softmax(-1)
    order = probs.argsort(descending=True)
    # the two best tokens (3.0 and 2.9) carry less than 0.5 together; with a tiny top_p only the best stays
    p = SamplingParams(temperature=1.0, top_p=float(probs[order[0]]) * 0.99)
    draws = {Sampler(s)(logits(L), [row(p)]).token_ids[0] for s in range(30)}
    assert draws == {3}
    head = float(probs[order[0]] + probs[order[1]])
    p = SamplingParams(temperature=1.0, top_p=head * 0.999)  # first two reach it: exactly {3, 11}
    draws = {Sampler(s)(logits(L), [row(p)]).token_ids[0] for s in range(60)}
    assert draws == {3, 11}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = torch.tensor(L).softmax(-1)
    # keep tokens with p >= 0.5 * p_max: logits >= 3.0 - ln 2 = 2.307 -> indices 3, 7, 11
    p = SamplingParams(temperature=1.0, min_p=0.5)
    draws = {Sampler(s)(logits(L), [row(p)]).token_ids[0] for s in range(80)}
    assert draws == {i for i in range(VOCAB) if probs[i] >= 0.5 * probs.max()} == {3, 7, 11}


def test_seeded_rows_ignore_their_batch():
    def draw(batch_size: int, position: int) -> list[int]:
        tokens = []
        g = torch.Generator().manual_seed(1234)
        for _ in range(20):
            rows = [row(SamplingParams(temperature=1.0))] * batch_size
            rows[position] = row(SamplingParams(temperature=1.0, seed=1234), generator=g)
            tokens.append(Sampler(99)(logits(*[L] * batch_size), rows).token_ids[position])
        return tokens

    alone = draw(1, 0)
    assert draw(5, 3) == alone == draw(3, 0)
    assert len(set(alone)) > 2  # it really samples


def test_sampling_follows_the_distribution():
    p = SamplingParams(temperature=0.7)
    n = 4000
    counts = torch.zeros(VOCAB)
    out = Sampler(0)(logits(*[L] * n), [row(p)] * n).token_ids
    counts.index_add_(0, torch.tensor(out), torch.ones(n))
    expected = (torch.tensor(L) / 0.7).softmax(-1)
    assert (counts / n - expected).abs().max() < 0.03


def test_exponential_race_follows_the_distribution():
    """The CUDA default for plain rows (temperature only), run here on the CPU."""
    n = 4000
    rows = [row(SamplingParams(temperature=0.7))] * (n - 1) + [row(SamplingParams(temperature=0))]
    out = Sampler(0, race=True)(logits(*[L] * n), rows).token_ids
    assert out[-1] == 3  # the greedy row
    counts = torch.zeros(VOCAB).index_add_(0, torch.tensor(out[:-1]), torch.ones(n - 1))
    expected = (torch.tensor(L) / 0.7).softmax(-1)
    assert (counts / (n - 1) - expected).abs().max() < 0.03


def test_a_grammar_row_never_takes_the_race_path_that_ignores_masks():
    """On CUDA plain rows skip the slow path; a row with a grammar mask must not."""
    allowed = torch.tensor([1 << 2], dtype=torch.int32)  # only token 2 (L's second lowest)
    rows = [SamplingRow(SamplingParams(temperature=t), None, [1], [], frozenset(), allowed) for t in (0, 0.7)]
    assert Sampler(0, race=True)(logits(L, L), rows).token_ids == [2, 2]


def test_penalties_match_reference():
    prompt, output = [1, 2, 7], [3, 3, 5, 7]
    p = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25,
                       logprobs=None)
    ref = torch.tensor(L)
    for t in set(prompt + output):  # repetition over prompt and output
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
    for t in set(output):  # frequency and presence over the output only
        ref[t] -= 0.4 * output.count(t) + 0.25
    from ember.runner import sampler as s

    got = s._apply_penalties(logits(L), [row(p, prompt, output)])
    torch.testing.assert_close(got[0], ref)
    assert Sampler(0)(logits(L), [row(p, prompt, output)]).token_ids == [int(ref.argmax())]


def test_penalties_leave_other_rows_alone():
    from ember.runner import sampler as s

    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0, presence_penalty=2.0), output=[3])]
    got = s._apply_penalties(logits(L, L), rows)
    assert torch.equal(got[0], torch.tensor(L))
    assert got[1, 3] == L[3] - 2.0


def test_logit_bias_and_min_tokens():
    p = SamplingParams(temperature=0, logit_bias={6: 10.0})
    assert Sampler(0)(logits(L), [row(p)]).token_ids == [6]  # -2 + 10 = 8 beats 3.0
    eos_first = list(L)
    eos_first[0] = 9.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    # before min_tokens, neither EOS (0) nor stop token 3 may come: the best other is 11
    assert Sampler(0)(logits(eos_first), [row(p, output=[5])]).token_ids == [11]
    assert Sampler(0)(logits(eos_first), [row(p, output=[5, 5])]).token_ids == [0]
    p = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert Sampler(0)(logits(eos_first), [row(p, output=[5])]).token_ids == [0]


def test_logprobs_are_raw_log_softmax_with_rank_and_top_n():
    p = SamplingParams(temperature=0, logprobs=3, presence_penalty=2.0)
    out = Sampler(0)(logits(L), [row(p, output=[3])])
    lp = torch.tensor(L).log_softmax(-1)
    t = out.unpack_logprobs()[0]
    assert t.token_id == out.token_ids[0] == 11  # the penalty moved the choice off 3 ...
    assert math.isclose(t.logprob, float(lp[11]), rel_tol=1e-6)  # ... but logprobs are the raw ones
    assert t.rank == 2
    assert t.top_ids == [3, 11, 7]
    assert t.top_logprobs == pytest.approx(lp[[3, 11, 7]].tolist(), rel=1e-6)


def test_logit_bias_of_several_rows_is_one_scatter_add_per_row_position():
    rows = [row(SamplingParams(temperature=0, logit_bias={6: 10.0, 2: 0.5})), row(SamplingParams(temperature=0)),
            row(SamplingParams(temperature=0, logit_bias={9: 4.0, 6: -1.0}))]
    from ember.runner import sampler as s

    got = s._apply_bias_and_min_tokens(logits(L, L, L), rows)
    want = torch.tensor([L, L, L])
    want[0, 6] += 10.0
    want[0, 2] += 0.5
    want[2, 9] += 4.0
    want[2, 6] -= 1.0
    torch.testing.assert_close(got, want)
    assert Sampler(0)(logits(L, L, L), rows).token_ids == [6, 3, 9]  # 8.0 > 3.0; 3.5 > 3.0


def test_a_huge_top_k_is_no_filter():
    p = SamplingParams(temperature=1.0, top_k=2**63 - 1, seed=1)
    q = SamplingParams(temperature=1.0, seed=1)
    gens = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)]
    assert Sampler(0)(logits(L), [row(p, generator=gens[0])]).token_ids == \
        Sampler(0)(logits(L), [row(q, generator=gens[1])]).token_ids


def test_a_temperature_below_1e_5_is_greedy():
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert Sampler(0)(logits(L), [row(SamplingParams(temperature=1e-40))]).token_ids == [3]


def test_constrained_rows_with_nan_or_nothing_allowed_are_flagged_invalid():
    only_2 = torch.tensor([1 << 2], dtype=torch.int32)
    none = torch.tensor([0], dtype=torch.int32)
    nan = [float("nan")] * VOCAB
    rows = [SamplingRow(SamplingParams(temperature=0), None, [1], [], frozenset(), allowed)
            for allowed in (only_2, none, only_2, None)]
    out = Sampler(0)(logits(L, L, nan, nan), rows)
    assert out.invalid.tolist() == [False, True, True, False]  # a free NaN row is not the grammar's business
    assert out.token_ids[0] == 2
    assert Sampler(0)(logits(L), [row(SamplingParams(temperature=0))]).invalid is None  # no grammar: no check


def test_allowed_token_ids_keep_only_those_and_bad_words_ban_their_last_token():
    # L's best are 3 (3.0), 11 (2.9), 7 (2.5)
    only = SamplingParams(temperature=0, allowed_token_ids=[2, 6, 9])
    assert Sampler(0)(logits(L), [row(only)]).token_ids == [9]  # -0.5 is the best of -1, -2, -0.5
    drawn = Sampler(0)(logits(*[L] * 64), [row(SamplingParams(temperature=1.0, allowed_token_ids=[2, 6]))] * 64)
    assert set(drawn.token_ids) == {2, 6}  # 64 draws from e^-1 : e^-2 take both, nothing else
    bad = SamplingParams(temperature=0, bad_words_token_ids=[[3], [5, 11]])
    assert Sampler(0)(logits(L), [row(bad)]).token_ids == [11]  # 3 is banned outright
    assert Sampler(0)(logits(L), [row(bad, output=[4, 5])]).token_ids == [7]  # after 5, 11 would end "5 11"
    mixed = Sampler(0)(logits(L, L), [row(bad, output=[5]), row(SamplingParams(temperature=0))])
    assert mixed.token_ids == [7, 3]  # the other row keeps its best
    nothing = SamplingParams(temperature=0, allowed_token_ids=[3], bad_words_token_ids=[[3]])
    assert Sampler(0)(logits(L), [row(nothing)]).invalid.tolist() == [True]  # nothing left: never emitted


def test_a_spent_thinking_budget_forces_the_end_of_the_reasoning_token_by_token():
    p = SamplingParams(temperature=0, thinking_token_budget=2, thinking_end_token_ids=[9, 6])
    assert Sampler(0)(logits(L), [row(p, output=[4])]).token_ids == [3]  # under budget: its own best
    assert Sampler(0)(logits(L), [row(p, output=[4, 5])]).token_ids == [9]  # spent: the end's first token
    assert Sampler(0)(logits(L), [row(p, output=[4, 5, 9])]).token_ids == [6]  # then the rest of it
    assert Sampler(0)(logits(L), [row(p, output=[4, 5, 9, 6])]).token_ids == [3]  # ended: free again
    assert Sampler(0)(logits(L), [row(p, output=[9, 6, 1, 1])]).token_ids == [3]  # it ended on its own
    with pytest.raises(ValueError, match="thinking_end_token_ids"):
        SamplingParams(thinking_token_budget=2)


THINK = dict(thinking_token_budget=5, thinking_end_token_ids=[9, 6])


@pytest.mark.parametrize("params, output, ahead, edits", [
    (dict(temperature=0), (), 4, False),
    (dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, seed=3, logprobs=2), (), 4, False),  # after _processed
    (dict(logit_bias={3: 1.0}), (), 1, True),
    (dict(min_tokens=3), (4, 5), 4, True),
    (dict(min_tokens=3), (4, 5, 7), 4, False),  # met: the drafts only add to the output
    (dict(allowed_token_ids=[1, 2]), (), 1, True),
    (dict(bad_words_token_ids=[[4, 5]]), (), 1, True),  # whether or not the output ends with 4
    (dict(repetition_penalty=1.2), (), 1, True),
    (dict(frequency_penalty=0.5), (), 1, True),
    (dict(presence_penalty=-0.5), (), 1, True),
    (THINK, (1, 2), 3, False),  # positions 2, 3, 4: under the budget of 5
    (THINK, (1, 2), 4, True),  # position 5 reaches it
    (THINK, (1, 2, 3, 4, 5), 1, True),  # spent: the end is forced
    (THINK, (1, 9, 6, 4, 5, 7), 4, False),  # it ended already
    (THINK, (1, 2, 3, 4, 5, 9), 1, True),  # half the end written
])
def test_edits_logits_says_whether_the_sampler_edits_a_rows_logits(params, output, ahead, edits):
    """The predicate, and where it says no the sampler's edits leave the logits as they are at
    each of the `ahead` positions, whatever tokens the output grows by."""
    r = row(SamplingParams(**params), output=output)
    assert edits_logits(r, ahead) == edits
    if not edits:
        for j in range(ahead):
            for token in (0, 3, 9, 6):
                grown = row(r.params, output=list(output) + [token] * j)
                assert torch.equal(_processed(logits(L), [grown]), logits(L))


def test_a_grammar_row_edits_its_logits():
    r = row(SamplingParams(temperature=0))
    r.allowed = torch.full((1,), -1, dtype=torch.int32)
    assert edits_logits(r) and not edits_logits(row(SamplingParams(temperature=0)))
