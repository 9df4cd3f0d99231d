"""The n-gram proposer's drafts and --speculative-config's parsing, exactly."""

from __future__ import annotations

import pytest

from ember.config import EngineConfig
from ember.runner.model_runner import decode_graph_rows
from ember.spec_decode.config import SpeculativeConfig
from ember.spec_decode.ngram import NgramProposer


def test_the_longest_suffix_wins_and_its_latest_occurrence_gives_the_drafts():
    p = NgramProposer(3, lookup_min=1, lookup_max=3)
    #           0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 8, 9, 1, 2, 7, 8, 5, 6, 3, 7, 8]
    # the suffix [3, 7, 8] never occurred before; [7, 8] did at 0 and 5: the latest (5) is followed by 5, 6, 3
    assert p.propose(tokens) == [5, 6, 3]
    assert p.propose(tokens, k=1) == [5]
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]  # [1, 2, 3] at 0
    # drafts stop at the end of the context
    assert NgramProposer(5, 1, 2).propose([4, 5, 6, 4, 5]) == [6, 4, 5]


def test_no_suffix_of_lookup_min_tokens_occurred_before_gives_no_drafts():
    assert NgramProposer(4, lookup_min=2, lookup_max=4).propose([1, 2, 3, 1, 9]) == []  # only [9] / [1, 9]
    assert NgramProposer(4, lookup_min=1, lookup_max=4).propose([1, 2, 3, 1, 9]) == []
    assert NgramProposer(4, lookup_min=1, lookup_max=4).propose([1, 2, 3, 9, 1]) == [2, 3, 9, 1]
    assert NgramProposer(4, lookup_min=2, lookup_max=2).propose([5, 5]) == []  # the suffix itself is not a match
    assert NgramProposer(4, lookup_min=1, lookup_max=2).propose([5, 5, 5]) == [5]  # overlapping runs are
    assert NgramProposer(2, 1, 3).propose([]) == [] and NgramProposer(2, 1, 3).propose([1, 2, 1], k=0) == []


def test_vllm_json_parses_with_vllm_defaults():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}') == SpeculativeConfig(
        "ngram", 4, prompt_lookup_max=5, prompt_lookup_min=5)
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    one = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                   "disable_by_batch_size": 8})
    assert (one.method, one.prompt_lookup_min, one.prompt_lookup_max, one.disable_by_batch_size) == \
        ("ngram", 2, 4, 8)
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert config.speculative_config == SpeculativeConfig("ngram", 2)
    draft = SpeculativeConfig.parse({"model": "/models/small", "num_speculative_tokens": 3})  # vLLM: a model alone
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/small", 3)


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3}', "method 'eagle' .EAGLE-1 heads .EAGLE-3 "
                                                                        "heads: method 'eagle3'.. is not supported yet"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "method 'eagle3' needs \"model\": the EAGLE-3 head's path"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method 'draft_model' needs \"model\""),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 3}, "method 'ngram' takes no model"),
    ({"method": "medusa", "model": "d", "num_speculative_tokens": 3}, "'medusa' .Medusa heads. is not supported"),
    ({"method": "lookahead", "num_speculative_tokens": 3}, "unknown method 'lookahead'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) is more than prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "key 'draft_tensor_parallel_size' is not supported"),
    ("ngram", "must be a JSON object"),
])
def test_what_ember_does_not_do_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_speculation_takes_async_scheduling():
    """The engine core falls back to a synchronous step where drafts need it
    (tests/engine/test_spec_async.py)."""
    config = EngineConfig(speculative_config={"num_speculative_tokens": 2}, async_scheduling=True)
    assert config.async_scheduling is True and config.speculative_config.num_speculative_tokens == 2


def test_the_decode_graphs_hold_a_step_verifying_every_requests_drafts():
    """K + 1 decode rows a request, up to 512 rows (vLLM's cap) and the step's token budget."""
    def rows(k: int | None, seqs: int, tokens: int = 8192) -> int:
        spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
        return decode_graph_rows(EngineConfig(speculative_config=spec, max_num_seqs=seqs,
                                              max_num_batched_tokens=tokens))

    assert [rows(None, 256), rows(4, 1), rows(4, 32), rows(4, 256), rows(7, 100), rows(4, 64, tokens=200),
            rows(4, 600)] == [256, 5, 160, 512, 512, 200, 600]
