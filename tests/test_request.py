"""Request's own helpers."""

from __future__ import annotations

from ember.request import Request
from ember.sampling_params import SamplingParams


def test_token_slice_is_the_slice_of_all_token_ids():
    req = Request("r", [10, 11, 12, 13], SamplingParams(max_tokens=8))
    for outputs in ([], [20], [20, 21, 22]):
        req.output_token_ids = list(outputs)
        total = len(req.all_token_ids)
        for start in range(total + 2):
            for end in range(total + 3):
                assert req.token_slice(start, end) == req.all_token_ids[start:end], (outputs, start, end)
