"""Speculative decoding: a cheap proposer guesses a request's next K tokens, one target forward
verifies them all (K + 1 query rows over the paged cache), and the longest run the target agrees
with is kept, plus one token of the target's own.

    config.py     SpeculativeConfig: vLLM's --speculative-config JSON, validated
    proposer.py   what the engine core asks for drafts (`propose_for`)
    ngram.py      NgramProposer: prompt lookup over the request's own prompt and output
    (runner/draft_model.py: the draft_model method, a smaller model of the same vocabulary with
    its own KV cache on the target's block ids, drafting greedily; runner/eagle3.py: the eagle3
    method, an EAGLE-3 head (models/eagle3.py) reading the target's hidden states, likewise)

Where the rest lives: the scheduler plans a request's drafts as extra query tokens of its decode
chunk (scheduler.py `_add_drafts`) and rolls back the KV of the rejected ones (`_accept_drafts`);
the runner gives every drafted position its own sampling row, whose context holds the drafts
before it (model_runner.py); the engine core asks for the next drafts after each step (core.py).

Why the rows alone keep the target's distribution: a draft from a proposer without probabilities
(n-gram, a draft model's argmax) is a point mass q = 1 on one token d. Speculative sampling then
accepts d with probability min(1, p(d) / q(d)) = p(d) and, on rejection, draws from
max(p - q, 0) normalized = p without d. Drawing x ~ p at the position and keeping d iff x == d
does exactly that, so each row samples as it would without speculation (temperature, top-k/p,
penalties over its own context, a seed), and the run is cut at the first row whose token differs
from its draft. Greedy rows are the special case: the output is token for token the output
without speculation.
"""
