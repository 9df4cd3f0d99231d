"""Beam search as transformers' `generate(num_beams=k, do_sample=False)` runs it, one prompt a
`BeamSearch`: the engine gives each running beam's top log-probabilities for its next token, and
`advance` picks the next beams and the finished hypotheses exactly as transformers' vectorized
beam search does (its steps and masks, in float32):

    candidates   the top 2k of (beam score + log p(token)) over the running beams' tokens
    finished     those among the top k that end (EOS, or max_tokens reached), scored
                 sum / generated_length ** length_penalty, merged into the k best so far
    running      the top k candidates that do not end
    stop         when no running beam can beat the worst finished one (early_stopping False:
                 at its current length; "never": at max length), when every slot is finished
                 (early_stopping True), or when every candidate ends

The engine runs each search's beams as requests of its own (engine/beam_groups.py): a beam
that continues another shares its blocks, as a fork. `beam_search_output` reads a finished
search's request output (LLM.beam_search, the server's use_beam_search)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ember.outputs import RequestOutput
from ember.sampling_params import BeamSearchParams

NEG = np.float32(-1.0e9)  # transformers' "impossible" score


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's and the generated ones
    cum_logprob: float  # the generated tokens' summed log-probabilities
    score: float  # cum_logprob / generated_length ** length_penalty: the order of the sequences
    text: str | None = None  # the generated tokens decoded
    finish_reason: str = "length"  # "stop" (it ended with EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


class BeamSearch:
    """One prompt's beams. `advance(tops)`: each running beam's {token: log p} of at least 2k
    tokens; `parents` then says what each new running beam continues; until `done`, when
    `finished` holds the hypotheses, best first."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: set[int]) -> None:
        self.prompt, self.params = list(prompt), params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        k = params.beam_width
        # transformers starts with k copies of the prompt, all but the first at -1e9: only the
        # first one's tokens can be chosen first, so it alone is asked about
        self.running: list[tuple[list[int], np.float32]] = [([], np.float32(0.0))]
        self.parents: list[tuple[int, int]] = []  # each running beam's (beam it continues, its new token)
        # k slots: (tokens, score, filled, summed log-probabilities)
        self.finished: list[tuple[list[int], np.float32, bool, np.float32]] = [([], NEG, False, NEG)] * k
        self.generated = 0
        self.unsatisfied = True
        self.done = False

    def advance(self, tops: list[dict[int, float]]) -> None:
        p, k = self.params, self.params.beam_width
        if k == 1:  # transformers' num_beams=1 is greedy search: the best token until EOS or max_tokens
            (tokens, score), top = self.running[0], tops[0]
            token = min(top, key=lambda t: (-top[t], t))
            cum = np.float32(score + np.float32(top[token]))
            self.running, self.generated = [(tokens + [token], cum)], self.generated + 1
            self.parents = [(0, token)]
            self.done = token in self.eos or self.generated >= p.max_tokens
            if self.done:
                self.finished = [(tokens + [token], np.float32(cum / np.float32(self.generated ** p.length_penalty)),
                                  True, cum)]
            return
        keep = 2 * k
        candidates = []  # (score, beam index, token): in the order torch.topk gives them
        for b, ((tokens, score), top) in enumerate(zip(self.running, tops)):
            candidates += [(np.float32(score + np.float32(lp)), b, t) for t, lp in top.items()]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:keep]
        last = self.generated + 1 >= p.max_tokens
        hits = [last or t in self.eos for _, _, t in candidates]
        seqs = [self.running[b][0] + [t] for _, b, t in candidates]
        # the running beams: the k best that do not end
        masked = [(s + NEG if h else s, i) for i, ((s, _, _), h) in enumerate(zip(candidates, hits))]
        order = sorted(range(len(masked)), key=lambda i: (-masked[i][0], i))[:k]
        running = [(seqs[i], np.float32(masked[i][0])) for i in order]
        self.parents = [candidates[i][1:] for i in order]
        # the finished: the top k candidates that end, scored by length, merged with the best so far (a
        # running score is its beam's summed log-probabilities; the powers in double, as Python's)
        length = np.float32((self.generated + 1) ** p.length_penalty)
        full = all(f for _, _, f, _ in self.finished) and p.early_stopping is True
        merged = list(self.finished)
        for i, ((s, _, _), h) in enumerate(zip(candidates, hits)):
            just = h and i < k
            score = np.float32(s / length)
            if full:
                score = score + NEG
            if not self.unsatisfied:
                score = score + NEG
            if not just:
                score = score + NEG
            merged.append((seqs[i], np.float32(score), just, s))
        order = sorted(range(len(merged)), key=lambda i: (-merged[i][1], i))[:k]
        self.finished = [merged[i] for i in order]
        self.running = running
        self.generated += 1
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            best_length = p.max_tokens
        else:
            best_length = self.generated
        best = np.float32(self.running[0][1] / np.float32(best_length ** p.length_penalty))
        worst = min(s for _, s, _, _ in self.finished)
        self.unsatisfied = self.unsatisfied and any(best > (worst if f else NEG) for _, _, f, _ in self.finished)
        open_beam = not (all(f for _, _, f, _ in self.finished) and p.early_stopping is True)
        self.done = not (self.unsatisfied and open_beam and not all(hits))


def beam_search_output(out: RequestOutput, params: BeamSearchParams, decode=None) -> BeamSearchOutput:
    """A finished beam search's sequences, best first, from its request's output (a sample a
    hypothesis, with its summed log-probabilities; the score as `advance` computes it)."""
    if out.error is not None:
        raise RuntimeError(f"the beam search of request {out.request_id} failed: {out.error}")
    sequences = []
    for c in out.outputs:
        cum = np.float32(c.cumulative_logprob)
        score = np.float32(cum / np.float32(len(c.token_ids) ** params.length_penalty))
        sequences.append(BeamSearchSequence(list(out.prompt_token_ids) + list(c.token_ids), float(cum), float(score),
                                            decode(c.token_ids) if decode is not None else None, c.finish_reason))
    return BeamSearchOutput(sequences)
