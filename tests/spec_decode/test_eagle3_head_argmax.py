"""Eagle3Head.target_argmax: the argmax of the head's logits over the target's vocabulary, from
the draft vocabulary's own argmax where d2t keeps the draft ids' order (the greedy drafts'
path, runner/eagle3.py), ties and all."""

from __future__ import annotations

import torch
from torch import nn

from ember.bench.dummy_eagle3 import head_config
from ember.layers.attention import get_attention_backend
from ember.models.eagle3 import Eagle3Config, Eagle3Head


def test_the_heads_argmax_is_the_target_logits_argmax():
    """Eagle3Head.target_argmax against target_logits(...).argmax: ties (the first), NaN, +inf,
    a row of -inf only, with d2t's target ids ascending (the mapped draft argmax) or not."""
    config = Eagle3Config.from_hf_config(head_config(8, 16, 6, [1, 4, 6]), [])
    head = Eagle3Head(config, 64, get_attention_backend("torch"))
    head.lm_head = nn.Identity()  # its "normed" rows are the draft logits
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[1.0, 3, 3, 2, 0, 3], [nan, 1, nan, 5, 0, 0], [-inf] * 6, [inf, 0, inf, 1, 0, 0],
                           [-inf, -inf, 2, -inf, 2, -inf], [0.5, -1, 0.25, 0.5, 0.5, -2]])
    logits = torch.cat([logits, torch.randn(20, 6, generator=torch.Generator().manual_seed(0)).round()])  # ties
    for target_ids, ascending in [([1, 2, 5, 8, 9, 15], True), ([0, 1, 2, 3, 4, 5], True),
                                  ([3, 1, 2, 8, 9, 15], False), ([1, 2, 5, 8, 9, 9], False)]:
        head.d2t.copy_(torch.tensor(target_ids) - torch.arange(6))
        assert head.ascending_d2t(16) == ascending
        want = head.target_logits(logits, 16).argmax(dim=-1).tolist()
        assert head.target_argmax(logits, 16, ascending).tolist() == want
    head.d2t.copy_(torch.tensor([1, 2, 5, 8, 9, 16]) - torch.arange(6))
    assert not head.ascending_d2t(16)  # a target id past the vocabulary
