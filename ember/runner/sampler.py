"""Batched sampling with per-request parameters, one row of logits per sampled token.

Order: logit_bias and min_tokens, allowed_token_ids and bad words, then penalties (repetition over prompt and output,
frequency and presence over the output), then the grammar's mask (structured output:
forbidden tokens get -inf), then greedy argmax or temperature, top-k, top-p, min-p and a
draw. Logprobs are those of the raw logits. (vLLM masks before the penalties; as every
edit before it keeps -inf at -inf, the order gives the same tokens.)

Speculative decoding: a row that verifies a draft drawn from a drafter's distribution q
(`SamplingRow.draft`) keeps it or draws its replacement by speculative sampling
(`verify_drafts`); `Sampler.draft` is how a drafter draws its drafts and q, by the same
processing of its own logits.

Rows come checked: SamplingParams validated every value's type and range, and the runner
builds each row (its generator, its logit_bias tensors) in a per-request step whose
failure fails that request alone. A constrained row whose masked logits hold a NaN or
allow nothing is flagged in `SamplerOutput.invalid`: its token must never be emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ember.layers.transfer import to_device
from ember.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own: its draws ignore the batch
    prompt_ids: list[int]
    output_ids: list[int]
    eos_ids: frozenset[int]
    allowed: torch.Tensor | None = None  # structured output: int32 bits of the tokens allowed next
    bias: LogitBias | None = None  # params.logit_bias as tensors (the runner builds it once a request)
    # speculative sampling: (the draft this row verifies, q: the [vocab] distribution the drafter
    # drew it from, Sampler.draft's). None: the row draws from p (a draft without q is a point mass)
    draft: tuple[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class LogitBias:
    """A request's logit_bias as two tensors on the logits' device: token ids and their biases."""

    token_ids: torch.Tensor  # [k] int64
    values: torch.Tensor  # [k] float32

    @staticmethod
    def of(bias: dict[int, float], device: torch.device) -> LogitBias:
        return LogitBias(to_device(list(bias), device, torch.int64), to_device(list(bias.values()), device,
                                                                               torch.float32))


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and rank, and the top-N alternatives (descending)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """t's copy on the CPU. With `pin` (CUDA): into pinned memory, queued behind the device's
    work without waiting for it; complete once an event recorded after it has passed."""
    if not pin:
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass
class PendingLogprobs:
    """Logprobs of some rows as the device computed them; `unpack` reads them. A step
    copies them with `to_host` and unpacks them when it is collected, so that asking
    for logprobs does not make the CPU wait for the device at launch."""

    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, k] int64, k = max(top_n)
    top_logprobs: torch.Tensor  # [R, k] float32
    top_n: list[int]

    def to_host(self, pin: bool) -> PendingLogprobs:
        return PendingLogprobs(*(to_host(t, pin) for t in (self.token_ids, self.logprobs, self.ranks, self.top_ids,
                                                           self.top_logprobs)), self.top_n)

    def unpack(self) -> list[TokenLogprobs]:
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [TokenLogprobs(ids[i], lps[i], ranks[i], top_ids[i][:n], top_lps[i][:n])
                for i, n in enumerate(self.top_n)]


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [rows] int64 on the logits' device; reading it waits for the device
    logprobs: PendingLogprobs | None = None  # of the rows that asked for them ...
    logprob_rows: list[int] = field(default_factory=list)  # ... which are these
    # grammar rows whose masked logits had a NaN or no allowed token: their token is
    # meaningless and must fail the request ([rows] bool on the logits' device), or None
    invalid: torch.Tensor | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.tolist()

    def unpack_logprobs(self) -> list[TokenLogprobs | None]:
        """One entry a row (reads the device)."""
        out: list[TokenLogprobs | None] = [None] * self.tokens.shape[0]
        if self.logprobs is not None:
            for row, lp in zip(self.logprob_rows, self.logprobs.unpack()):
                out[row] = lp
        return out


def _plain(r: SamplingRow) -> bool:
    """A row that needs only temperature (or argmax): no seed, filters, penalties, grammar or logprobs."""
    p = r.params
    return (r.generator is None and r.allowed is None and r.draft is None and not p.logit_bias and len(r.output_ids) >= p.min_tokens
            and p.allowed_token_ids is None and not p.bad_words_token_ids and p.thinking_token_budget is None
            and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0 and p.logprobs is None and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)


class Sampler:
    def __init__(self, seed: int, race: bool | None = None) -> None:
        """race: draw plain rows by an exponential race (default: on CUDA), see `_race`."""
        self.seed = seed
        self.race = race
        self.generator: torch.Generator | None = None  # for rows without a seed
        self.draws = 0  # Gumbel-max steps so far: each step's Philox seed

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [len(rows), vocab] in the model's dtype: the one-pass Gumbel kernel reads
        them as they are, every other path in float32. Tokens and logprobs stay on the
        device (SamplerOutput) for the caller to read back when it needs them."""
        if (self.race if self.race is not None else logits.is_cuda) and all(_plain(r) for r in rows):
            return SamplerOutput(self._race(logits, [r.params.temperature for r in rows]))
        raw = logits.float()
        logits = _processed(raw, rows)
        invalid = _invalid_grammar_rows(logits, rows)
        tokens, _ = self._tokens(logits, rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return SamplerOutput(tokens, invalid=invalid)
        idx = to_device(want, logits.device)
        return SamplerOutput(tokens, token_logprobs(raw[idx], tokens[idx], [rows[i].params.logprobs for i in want]),
                             want, invalid)

    def draft(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """A drafter's step: one token a row, as this sampler would draw it from these logits
        (the same processing: penalties over the row's context, which holds the drafts before
        it, then temperature, top-k/p, min-p; greedy rows take the argmax), and the
        distribution q each sampled row drew from ([vocab] float32; None for a greedy row)."""
        logits = _processed(logits.float(), rows)
        tokens, probs = self._tokens(logits, rows)
        sampled = iter(probs if probs is not None else ())
        return tokens, [None if r.params.greedy else next(sampled) for r in rows]

    def _tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's token from its processed logits: the argmax (greedy rows), a draw from p,
        or a draft kept or replaced by speculative sampling; and p of the sampled rows, in order."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampled:
            return tokens, None
        idx = to_device(sampled, logits.device)
        probs = _probs(logits[idx], [rows[i].params for i in sampled])
        generators = [rows[i].generator for i in sampled]
        u = self._uniforms(generators, logits.device)
        drawn = _inverse_cdf(probs, u)
        verifying = [j for j, i in enumerate(sampled) if rows[i].draft is not None]
        if verifying:  # the draft kept, or its replacement drawn with a second uniform
            at = to_device(verifying, logits.device)
            verified = [rows[sampled[j]] for j in verifying]
            # q masked like p: a draft the grammar refuses never reaches a row (it ends the run
            # before), so the drafts verified are q's draws conditioned on the grammar's tokens
            q = apply_grammar_masks(torch.stack([r.draft[1] for r in verified]), verified, fill=0.0)
            drafts = to_device([r.draft[0] for r in verified], logits.device, torch.int64)
            drawn[at] = verify_drafts(probs[at], q, drafts, u[at], self._uniforms([generators[j] for j in verifying],
                                                                                   logits.device))
        tokens[idx] = drawn
        return tokens, probs

    def warm_up(self, vocab_size: int, max_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        """Build the Gumbel kernel's variants for one row and for `max_rows` rows of logits
        in `dtype` before serving: on a cold Triton cache the first sampled step built them
        mid-serving (0.5 s of stall for every request in flight, BENCHMARKS.md)."""
        if device.type != "cuda":
            return
        from ember.kernels.sampling import gumbel_argmax

        for rows in sorted({1, max_rows}):
            gumbel_argmax(torch.zeros(rows, vocab_size, dtype=dtype, device=device), 1.0, seed=0)

    def _race(self, logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
        """argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i: one
        pass over the vocabulary, no cumulative sum or search; greedy rows take the argmax."""
        if all(t == 0 for t in temperatures):
            return logits.argmax(dim=-1)
        if self.generator is None or self.generator.device != logits.device:
            self.generator = torch.Generator(device=logits.device).manual_seed(self.seed)
        if len(set(temperatures)) == 1:  # one temperature (the common case): no host-to-device copy
            if logits.is_cuda:  # one Triton pass over the logits (Gumbel-max), seeded per step
                from ember.kernels.sampling import gumbel_argmax

                self.draws += 1
                return gumbel_argmax(logits, temperatures[0], seed=self.seed * 1_000_003 + self.draws)
            probs = (logits.float() / temperatures[0]).softmax(dim=-1)
            return probs.div_(torch.empty_like(probs).exponential_(generator=self.generator)).argmax(dim=-1)
        logits = logits.float()
        temps = to_device(temperatures, logits.device, torch.float32)[:, None]
        probs = (logits / torch.where(temps > 0, temps, 1.0)).softmax(dim=-1)
        drawn = probs.div_(torch.empty_like(probs).exponential_(generator=self.generator)).argmax(dim=-1)
        if any(t == 0 for t in temperatures):
            drawn = torch.where(temps[:, 0] > 0, drawn, logits.argmax(dim=-1))
        return drawn

    def _uniforms(self, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """[rows] uniform numbers in [0, 1), one a row: a seeded row's from its own generator,
        so that its draws depend on its own generator only."""
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        u = torch.rand(len(generators), generator=self.generator, device=device)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, device=device)
        return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row of `probs` ([rows, vocab], not necessarily normalized) by inverse CDF
    with the row's uniform u ([rows]): the first token whose cumulative mass passes u."""
    cdf = probs.cumsum(dim=-1)
    # zero-probability tokens never match
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def verify_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023; vLLM's rejection sampler), one drafted
    position a row: the token each row keeps, the draft or its replacement.

    p, q: [rows, vocab] float, the target's and the drafter's distributions at the position
    (normalized here: min-p leaves rows unnormalized); drafts: [rows] int64, d drawn from q
    (q(d) > 0); u, v: [rows] uniform in [0, 1). As plain torch:

        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        keep = u * q[d] < p[d]                      # probability min(1, p(d) / q(d))
        r = (p - q).clamp(min=0); r[d] = 0          # the residual max(p - q, 0), normalized
        token = d if keep else inverse_cdf(r, v)

    so that the token is distributed as p whatever q is: P(x) = min(p(x), q(x)) + (1 - sum
    min(p, q)) r(x) / sum r = p(x). A replacement never equals its draft (r[d] = 0: rejection
    means p(d) < q(d)), so the caller cuts the run where token != draft. Where float rounding
    leaves the residual no mass (p and q agree up to rounding), it is p without d."""
    p = p / p.sum(dim=-1, keepdim=True)
    q = q / q.sum(dim=-1, keepdim=True)
    at = drafts[:, None]
    keep = u * q.gather(1, at).squeeze(1) < p.gather(1, at).squeeze(1)
    residual = (p - q).clamp_(min=0).scatter_(1, at, 0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p.scatter(1, at, 0.0), residual)
    return torch.where(keep, drafts, _inverse_cdf(residual, v))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int]) -> PendingLogprobs:
    """log_softmax of each row; the given token's logprob and rank, and the top-N (on the
    device: see PendingLogprobs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
    top = lp.topk(max(top_n), dim=-1)
    return PendingLogprobs(tokens.view(-1), chosen, ranks, top.indices, top.values, list(top_n))


def _processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """float32 logits with every row's edits and masks before temperature: logit_bias and
    min_tokens, allowed tokens and bad words, penalties, the grammar's mask."""
    logits = _apply_bias_and_min_tokens(logits, rows)
    logits = _apply_allowed_and_bad_words(logits, rows)
    logits = _apply_penalties(logits, rows)
    return apply_grammar_masks(logits, rows)


def edits_logits(row: SamplingRow, ahead: int = 1) -> bool:
    """Whether `_processed` could edit the row's logits at one of its next `ahead` positions, its
    output one token longer at each (whatever the tokens): False means a greedy row takes the
    raw argmax there. Conservative: a row with bad words, say, counts as edited."""
    p, out = row.params, row.output_ids
    budget = p.thinking_token_budget
    # a budget forces the end of thinking once reached, until the output holds that end
    thinking = budget is not None and len(out) + ahead > budget \
        and (len(out) < budget or thinking_end_next(row) is not None)
    return (bool(p.logit_bias) or len(out) < p.min_tokens or p.allowed_token_ids is not None
            or bool(p.bad_words_token_ids) or thinking or _penalised(p) or row.allowed is not None)


def _apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    biased = [(i, r.bias or LogitBias.of(r.params.logit_bias, logits.device))
              for i, r in enumerate(rows) if r.params.logit_bias]
    banned = [(i, r) for i, r in enumerate(rows) if len(r.output_ids) < r.params.min_tokens]
    if not (biased or banned):
        return logits
    logits = logits.clone()
    if biased:  # every row's biases in one scatter-add
        ids = torch.cat([b.token_ids for _, b in biased])
        values = torch.cat([b.values for _, b in biased])
        dev = logits.device
        at = torch.repeat_interleave(to_device([i for i, _ in biased], dev, torch.int64),
                                     to_device([b.token_ids.shape[0] for _, b in biased], dev, torch.int64),
                                     output_size=ids.shape[0])
        logits.index_put_((at, ids), values, accumulate=True)
    for i, r in banned:  # nothing may end the request yet
        stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_ids))
        if stops:
            logits[i, list(stops)] = float("-inf")
    return logits


def banned_words_next(r: SamplingRow) -> list[int]:
    """The tokens that would complete one of the row's bad words now: a one-token word's
    always, a longer word's last where the output so far ends with the rest of it."""
    out = r.output_ids
    return [ids[-1] for ids in r.params.bad_words_token_ids or ()
            if len(ids) == 1 or (len(out) >= len(ids) - 1 and list(out[len(out) - len(ids) + 1:]) == ids[:-1])]


def thinking_end_next(r: SamplingRow) -> int | None:
    """The token a row's thinking budget forces now: once its output has that many tokens and
    has not ended the reasoning, the next token of thinking_end_token_ids; else None."""
    p, out = r.params, r.output_ids
    if p.thinking_token_budget is None or len(out) < p.thinking_token_budget:
        return None
    end = p.thinking_end_token_ids
    at = -1
    while True:  # ended already (list.index: a C-speed scan)?
        try:
            at = out.index(end[0], at + 1)
        except ValueError:
            break
        if list(out[at:at + len(end)]) == end:
            return None
    written = next(k for k in range(len(end) - 1, -1, -1) if k == 0 or list(out[-k:]) == end[:k])
    return end[written]


def _apply_allowed_and_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """allowed_token_ids: every other token gets -inf; bad words: the token that would
    complete one gets -inf; a spent thinking budget: only the next token of its end."""
    allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    allowed += [(i, [t]) for i, r in enumerate(rows) for t in [thinking_end_next(r)] if t is not None]
    banned = [(i, ids) for i, r in enumerate(rows) if r.params.bad_words_token_ids
              for ids in [banned_words_next(r)] if ids]
    if not (allowed or banned):
        return logits
    logits = logits.clone()
    for i, ids in allowed:
        keep = to_device(ids, logits.device, torch.int64)
        kept = logits[i, keep]
        logits[i] = float("-inf")
        logits[i, keep] = kept
    for i, ids in banned:
        logits[i, ids] = float("-inf")
    return logits


def _invalid_grammar_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    """[rows] bool: a constrained row with a NaN or no token left after its mask (None if
    no row is constrained). Sampling it would emit a token the grammar forbids."""
    if all(r.allowed is None and r.params.allowed_token_ids is None for r in rows):
        return None
    constrained = to_device([r.allowed is not None or r.params.allowed_token_ids is not None for r in rows],
                            logits.device, torch.bool)
    bad = logits.isnan().any(dim=-1) | ~(logits > float("-inf")).any(dim=-1)
    return bad & constrained


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, invert: bool = False) -> torch.Tensor:
    """int32 [rows, words] on the CPU (bit t % 32 of word t // 32 = token t allowed) ->
    bool [rows, vocab] (`invert`: True where forbidden). The int32 words are little-endian,
    so their bytes unpacked little-bit-first are the tokens in order (numpy's unpackbits:
    much faster than shifting in torch)."""
    words = bitmask.contiguous().numpy()
    if invert:
        words = np.invert(words)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)


def apply_grammar_masks(logits: torch.Tensor, rows: list[SamplingRow], fill: float = float("-inf")) -> torch.Tensor:
    """`fill` (-inf: logits; 0: probabilities) for the tokens a row's grammar forbids; rows
    without a grammar are untouched."""
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return logits
    bitmask = torch.stack([rows[i].allowed for i in masked])
    forbidden = unpack_bitmask(bitmask, logits.shape[1], invert=True).to(logits.device)
    if len(masked) == len(rows):
        return torch.where(forbidden, fill, logits)
    idx = to_device(masked, logits.device)
    logits = logits.clone()
    logits[idx] = torch.where(forbidden, fill, logits[idx])
    return logits


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    if not any(_penalised(r.params) for r in rows):
        return logits
    num_rows, vocab = logits.shape
    dev = logits.device
    counts = torch.zeros(num_rows, vocab + 1, device=dev)  # column `vocab` takes the padding
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=dev)
    for i, r in enumerate(rows):
        if _penalised(r.params):
            if r.output_ids:
                counts[i].index_add_(0, to_device(r.output_ids, dev), torch.ones(len(r.output_ids), device=dev))
            seen[i, to_device(r.prompt_ids + r.output_ids, dev, torch.int64)] = True
    counts, seen = counts[:, :vocab], seen[:, :vocab]
    rep = to_device([r.params.repetition_penalty for r in rows], dev)[:, None]
    freq = to_device([r.params.frequency_penalty for r in rows], dev)[:, None]
    pres = to_device([r.params.presence_penalty for r in rows], dev)[:, None]
    # repetition (HF / CTRL): tokens seen in prompt or output shrink toward "less likely"
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    # frequency and presence (OpenAI): over the generated tokens only
    return logits - freq * counts - pres * (counts > 0).float()


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = logits.device
    temperature = to_device([p.temperature for p in params], dev)[:, None]
    logits = logits / temperature
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        vocab = logits.shape[-1]
        top_k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], dev)
        top_p = to_device([p.top_p for p in params], dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cut = torch.arange(vocab, device=dev)[None, :] >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # top-p keeps the smallest head whose mass reaches top_p; the first token always stays
        cut = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], dev)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
