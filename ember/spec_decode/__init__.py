"""Speculative decoding: a cheap proposer guesses a request's next K tokens, one target forward
verifies them all (K + 1 query rows over the paged cache), and the longest run the target agrees
with is kept, plus one token of the target's own.

    config.py     SpeculativeConfig: vLLM's --speculative-config JSON, validated
    proposer.py   what the engine core asks for drafts (`propose_for`)
    ngram.py      NgramProposer: prompt lookup over the request's own prompt and output
    (runner/draft_model.py: the draft_model method, a smaller model of the same vocabulary with
    its own KV cache on the target's block ids; runner/eagle3.py: the eagle3 method, an EAGLE-3
    head (models/eagle3.py) reading the target's hidden states; both draw each draft through
    the runner: runner/sampler.py `Sampler.draft`)

Where the rest lives: the scheduler plans a request's drafts as extra query tokens of its decode
chunk (scheduler.py `_add_drafts`) and rolls back the KV of the rejected ones (`_accept_drafts`);
the runner gives every drafted position its own sampling row, whose context holds the drafts
before it (model_runner.py); the engine core asks for the next drafts after each step (core.py).

Why the output keeps the target's distribution: speculative sampling (Leviathan et al.). Row j
of a verifying chunk holds the target's p at drafted position j, after the same processing as
without speculation (temperature, top-k/p, min-p, penalties over its context, the grammar's
mask). Its draft d was drawn from the drafter's q; the row keeps d with probability
min(1, p(d) / q(d)), else draws from max(p - q, 0) normalized, which never gives d
(sampler.py `verify_drafts`); the run is cut at the first row whose token differs from its
draft, and a row after K kept drafts draws from p. Each kept or drawn token is distributed as p.

    draft_model, eagle3   a request that samples draws each draft from q: the drafter's logits
                          under the request's own sampling parameters (penalties counting the
                          drafts before it), so q is as close to p as the drafter allows; a
                          drafter that equals the target keeps every draft. q is masked by the
                          grammar like p: a draft the grammar refuses ends the run before it
                          reaches a row, so the drafts verified are q's draws among its tokens.
    ngram, greedy         a draft without probabilities is a point mass q = 1 on d: kept with
                          probability p(d), replaced by a draw from p without d. Drawing x ~ p
                          and keeping d iff x == d does exactly that, so those rows sample as
                          without speculation. A greedy request's drafts are argmaxes and its
                          output is token for token the output without speculation.

Seeds: a seeded request draws its drafts and its verifying rows' uniforms from its own
generator, so the same seed and the same batch give the same tokens on every run. They are not the tokens a run without speculation draws with that seed (its
generator is drawn from in another order): both are samples of the same distribution.
Logprobs are the target's, of its raw logits, for every kept token.
"""
