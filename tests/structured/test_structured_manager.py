"""The engine core's StructuredOutputManager on the real backends and tokenizer: the
jump-forward budgets (length, time), the compile timeout, the byte-bounded cache, and
one request's failing matcher failing that request alone (bitmasks, advance, ready)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

from ember.request import Request
from ember.sampling_params import SamplingParams
from ember.sampling_params import StructuredOutputsParams as S
from ember.scheduler.scheduler import ScheduledChunk, SchedulerOutput
from ember.structured import manager as manager_module
from ember.structured.base import CompiledGrammar, GrammarMatcher, bitmask_words
from ember.structured.manager import MAX_FORCED_TOKENS, GrammarAdvance, StructuredOutputManager

VOCAB = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
FAILED = "structured output failed: RuntimeError"


def make_manager(backend, **kwargs) -> StructuredOutputManager:
    return StructuredOutputManager(lambda: backend, backend.tokenizer, VOCAB, max_model_len=8192, **kwargs)


def request(request_id: str, so: S, max_tokens: int = 4000) -> Request:
    return Request(request_id, [1], SamplingParams(max_tokens=max_tokens, structured_outputs=so))


def admit(m: StructuredOutputManager, *reqs: Request) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Add the requests and wait until each is ready (-> its forced tokens) or failed (-> its message)."""
    for req in reqs:
        m.add(req)
    ready: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    deadline = time.monotonic() + 10
    while m.num_compiling and time.monotonic() < deadline:
        m.wait(1.0)
        now_ready, now_failed = m.ready()
        ready.update((r.request_id, forced) for r, forced in now_ready)
        failed.update((r.request_id, message) for r, message in now_failed)
    for req in reqs:
        for token in ready.get(req.request_id, []):
            req.append_token(token)
    return ready, failed


def sample(req: Request, token: int) -> None:
    """What the engine does with a sampled token before advance()."""
    req.append_token(token)


# -- jump-forward budgets ---------------------------------------------------------------


def test_a_long_forced_text_comes_in_budget_sized_pieces(backend, tok):
    text = ("The quick brown fox jumps over the lazy dog, then naps. " * 100)[:5000]
    m = make_manager(backend)
    req = request("long", S(grammar="root ::= " + json.dumps(text)))
    ready, _ = admit(m, req)
    pieces = [ready["long"]]
    while True:
        rest = text[len(tok.decode(req.output_token_ids)):]
        sample(req, tok.encode(rest, add_special_tokens=False)[0] if rest else 2)  # the model follows the text
        advance = m.advance(req)
        assert advance.accepted and advance.error is None
        if advance.terminated:
            break
        pieces.append(advance.forced)
        for token in advance.forced:
            req.append_token(token)
    assert tok.decode([t for t in req.output_token_ids if t != 2]) == text
    sizes = [len(p) for p in pieces]
    assert sizes[:4] == [MAX_FORCED_TOKENS] * 4 and max(sizes) == MAX_FORCED_TOKENS  # cut to the budget...
    assert sum(sizes) > 4 * MAX_FORCED_TOKENS  # ...and the rest came on later calls
    assert m.num_forced_tokens == sum(sizes)
    m.release("long")
    assert m.holds() == 0


def test_a_slow_jump_forward_turns_it_off_for_that_request(backend, tok, monkeypatch, caplog):
    m = make_manager(backend)
    monkeypatch.setattr(manager_module, "JUMP_FORWARD_SLOW_S", 0.0)  # every jump-forward is "slow"
    with caplog.at_level(logging.WARNING, logger="ember.structured.manager"):
        ready, _ = admit(m, slow := request("slow", S(json=PERSON)))
        monkeypatch.setattr(manager_module, "JUMP_FORWARD_SLOW_S", 10.0)
        assert tok.decode(ready["slow"]) == '{"name":'  # that call's tokens still count
        for token in tok.encode(' "Al"', add_special_tokens=False):
            sample(slow, token)
            assert m.advance(slow) == GrammarAdvance(True)  # no more jump-forward: ', "age": ' is sampled
        ready, _ = admit(m, fresh := request("fresh", S(json=PERSON)))  # another request keeps its own
        assert tok.decode(ready["fresh"]) == '{"name":'
        for token in tok.encode(' "Al"', add_special_tokens=False)[:-1]:
            sample(fresh, token)
            m.advance(fresh)
        sample(fresh, tok.encode(' "Al"', add_special_tokens=False)[-1])
        assert tok.decode(m.advance(fresh).forced) == ', "age":'
    assert [r.getMessage().split(": jump-forward took")[0] for r in caplog.records] == ["request slow"]
    assert caplog.records[0].getMessage().endswith("ms (over 0.0 ms): off for the rest of this request")
    m.release("slow")
    m.release("fresh")
    assert m.holds() == 0


# -- compiling: timeout, errors, the cache ----------------------------------------------


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_and_is_not_cached(backend, monkeypatch):
    gate, compiled = threading.Event(), []
    real_compile = backend.compile

    def held(so: S) -> CompiledGrammar:  # the real compile, held at a gate (it cannot be interrupted)
        compiled.append(so.regex)
        assert gate.wait(10)
        return real_compile(so)

    monkeypatch.setattr(backend, "compile", held)
    m = make_manager(backend, compile_timeout_s=0.05)
    first, queued = request("first", S(regex=r"[0-9]{7}")), request("queued", S(regex=r"[0-9]{8}"))
    m.add(first)
    m.add(queued)  # behind the first on the one worker thread
    start = time.monotonic()
    m.wait(5.0)  # wakes at the deadline, not after 5 s
    assert time.monotonic() - start < 1.0
    time.sleep(max(0.0, start + 0.06 - time.monotonic()))
    ready, failed = m.ready()
    message = "its grammar did not compile within 0.05 s"
    assert ready == [] and failed == [(first, message), (queued, message)]
    assert m.num_compiling == 0 and m.holds() == 0
    gate.set()
    again = request("again", S(regex=r"[0-9]{7}"))
    ready, failed = admit(m, again)
    assert ready == {"again": []} and failed == {}
    # the timed-out compile ran on but was not cached (compiled again); the queued one never ran
    assert compiled == [r"[0-9]{7}", r"[0-9]{7}"]


def test_a_compile_error_fails_its_request_with_the_compilers_message(backend):
    m = make_manager(backend)
    ready, failed = admit(m, request("loop", S(grammar='root ::= "a" root')))  # not validated: the offline path
    assert ready == {} and failed == {"loop": "invalid grammar for structured output: rule 'root' can never end "
                                              "(every expansion of it recurses forever), so no output could "
                                              "complete it"}
    assert m.holds() == 0


def test_the_cache_is_bounded_by_bytes_and_evicts_the_least_recently_used(backend, monkeypatch):
    real_compile = backend.compile
    compiled = []

    def counted(so: S) -> CompiledGrammar:
        compiled.append(so.regex)
        return real_compile(so)

    a, b, c = S(regex=r"[a-c]{3}x"), S(regex=r"[a-c]{3}yy"), S(regex=r"[a-c]{3}zzz")
    size = {so.regex: real_compile(so).memory_size_bytes + len(so.regex) for so in (a, b, c)}
    assert all(n > 0 for n in size.values())
    monkeypatch.setattr(backend, "compile", counted)
    m = make_manager(backend, cache_bytes=sum(size.values()) - 1)  # room for any two, not all three

    def use(so: S) -> None:
        ready, _ = admit(m, request("r", so))
        assert list(ready) == ["r"]
        m.release("r")

    use(a)
    use(b)
    use(a)  # a cache hit: `a` is now more recent than `b`
    assert compiled == [a.regex, b.regex]
    use(c)  # one byte over: `b`, the least recently used, goes
    use(a)
    assert compiled == [a.regex, b.regex, c.regex]
    use(b)  # compiled again; now `c` is the least recently used and goes
    use(a)
    use(c)
    assert compiled == [a.regex, b.regex, c.regex, b.regex, c.regex]
    assert m.holds() == 0


def test_xgrammars_own_compiler_cache_is_bounded(xgrammar_backend):
    from ember.structured.xgrammar_backend import COMPILER_CACHE_BYTES

    assert xgrammar_backend.compiler().cache_limit_bytes == COMPILER_CACHE_BYTES == 64 << 20


# -- one request's failing matcher fails that request alone ------------------------------


class Raising(GrammarMatcher):
    """A real matcher that raises RuntimeError from one of its methods (`fails`)."""

    def __init__(self, inner: GrammarMatcher, fails: str) -> None:
        self.inner, self.fails, self.calls = inner, fails, 0

    def _check(self, method: str) -> None:
        self.calls += 1
        if method == self.fails:
            raise RuntimeError(f"injected failure in {method}")

    def accept_token(self, token_id: int) -> bool:
        self._check("accept_token")
        return self.inner.accept_token(token_id)

    def accept_tokens(self, token_ids: list[int]) -> int:
        self._check("accept_tokens")
        return self.inner.accept_tokens(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._check("fill_bitmask")
        self.inner.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        self._check("is_terminated")
        return self.inner.is_terminated()

    def jump_forward(self) -> str:
        self._check("jump_forward")
        return self.inner.jump_forward()

    def rollback(self, num_tokens: int) -> None:
        self._check("rollback")
        self.inner.rollback(num_tokens)


class RaisingGrammar(CompiledGrammar):
    def __init__(self, inner: CompiledGrammar, fails: str) -> None:
        self.inner, self.fails, self.matchers = inner, fails, []

    def matcher(self) -> GrammarMatcher:
        self.matchers.append(Raising(self.inner.matcher(), self.fails))
        return self.matchers[-1]

    @property
    def memory_size_bytes(self) -> int:
        return self.inner.memory_size_bytes


@pytest.fixture
def faulty(backend, monkeypatch):
    """A manager on `backend` whose grammar for the regex `\\d{3}-<method>` raises from <method>."""
    real_compile = backend.compile
    grammars: dict[str, RaisingGrammar] = {}

    def compile_(so: S) -> CompiledGrammar:
        grammar = real_compile(so)
        if so.kind == "regex" and so.regex.startswith(r"\d{3}-"):
            grammar = grammars[so.regex[6:]] = RaisingGrammar(grammar, so.regex[6:])
        return grammar

    monkeypatch.setattr(backend, "compile", compile_)
    return make_manager(backend), grammars


def test_a_mask_that_raises_allows_every_token_in_its_row_only(faulty, tok, caplog):
    m, grammars = faulty
    good, bad = request("good", S(regex=r"\d{3}")), request("bad", S(regex=r"\d{3}-fill_bitmask"))
    ready, failed = admit(m, good, bad)
    assert set(ready) == {"good", "bad"} and failed == {}
    plan = SchedulerOutput([ScheduledChunk(good, 1), ScheduledChunk(bad, 1)])
    with caplog.at_level(logging.ERROR, logger="ember.structured.manager"):
        masks = m.bitmasks(plan)
    everything = torch.full((bitmask_words(VOCAB),), -1, dtype=torch.int32)
    expected = torch.zeros(1, bitmask_words(VOCAB), dtype=torch.int32)
    m.backend.compile(S(regex=r"\d{3}")).matcher().fill_bitmask(expected, 0)
    assert torch.equal(masks["bad"], everything) and torch.equal(masks["good"], expected[0])
    assert m.take_failures() == {"bad": FAILED} and m.take_failures() == {}  # reported once
    assert "request bad: structured output failed while filling its token mask" in caplog.text
    assert "RuntimeError: injected failure in fill_bitmask" in caplog.text  # the traceback is logged
    # not touched again until released: its row allows everything, no new failure
    calls = grammars["fill_bitmask"].matchers[0].calls
    masks = m.bitmasks(plan)
    assert torch.equal(masks["bad"], everything) and torch.equal(masks["good"], expected[0])
    assert grammars["fill_bitmask"].matchers[0].calls == calls and m.take_failures() == {}
    sample(bad, tok.encode("x", add_special_tokens=False)[0])
    assert m.advance(bad) == GrammarAdvance(False, error=FAILED)
    sample(good, tok.encode("1", add_special_tokens=False)[0])
    assert m.advance(good) == GrammarAdvance(True)
    m.release("good")
    m.release("bad")
    assert m.holds() == 0


def test_a_failure_in_bitmasks_is_reported_once_by_advance_if_it_comes_first(faulty, tok):
    m, _ = faulty
    bad = request("bad", S(regex=r"\d{3}-fill_bitmask"))
    admit(m, bad)
    m.bitmasks(SchedulerOutput([ScheduledChunk(bad, 1)]))
    sample(bad, tok.encode("1", add_special_tokens=False)[0])
    assert m.advance(bad) == GrammarAdvance(False, error=FAILED)
    assert m.take_failures() == {}
    m.release("bad")
    assert m.holds() == 0


@pytest.mark.parametrize("method", ["accept_token", "is_terminated"])
def test_an_advance_that_raises_fails_that_request_only(faulty, tok, method, caplog):
    m, _ = faulty
    good, bad = request("good", S(regex=r"\d{3}")), request("bad", S(regex=r"\d{3}-" + method))
    admit(m, good, bad)
    one = tok.encode("1", add_special_tokens=False)[0]
    sample(bad, one)
    sample(good, one)
    with caplog.at_level(logging.ERROR, logger="ember.structured.manager"):
        assert m.advance(bad) == GrammarAdvance(False, error=FAILED)
    assert m.advance(good) == GrammarAdvance(True)
    assert m.advance(bad) == GrammarAdvance(False, error=FAILED)  # it stays failed until released
    assert "request bad: structured output failed while following its sampled token" in caplog.text
    assert f"RuntimeError: injected failure in {method}" in caplog.text
    # a token the grammar refuses is not an error
    sample(good, tok.encode("x", add_special_tokens=False)[0])
    assert m.advance(good) == GrammarAdvance(False)
    m.release("good")
    m.release("bad")
    assert m.holds() == 0 and m.take_failures() == {}


def test_a_matcher_that_raises_at_the_start_fails_its_request_in_ready(faulty, caplog):
    m, _ = faulty
    good = request("good", S(json=PERSON))
    bad = request("bad", S(regex=r"\d{3}-jump_forward"))
    with caplog.at_level(logging.ERROR, logger="ember.structured.manager"):
        ready, failed = admit(m, good, bad)
    assert list(ready) == ["good"] and len(ready["good"]) > 1  # its own jump-forward ran
    assert failed == {"bad": FAILED}
    assert "RuntimeError: injected failure in jump_forward" in caplog.text
    m.release("good")
    assert m.holds() == 0  # the failed request left nothing behind


# -- speculative decoding -------------------------------------------------------------------


def test_drafts_are_kept_as_far_as_the_grammar_accepts_and_each_position_gets_its_mask(backend, tok):
    """draftable() cuts a run at the first token the grammar refuses and before the one that
    completes it; bitmasks() gives a verifying chunk one row a position (row j after drafts[:j]),
    and advance() then takes the whole accepted run. The matcher ends each call where it began."""
    m = make_manager(backend, jump_forward=False)
    req = request("d", S(choice=["yes please", "no thanks"]))
    admit(m, req)
    ids = tok.encode("yes please", add_special_tokens=False)
    assert len(ids) >= 2
    bad = tok.encode("maybe", add_special_tokens=False)[0]
    assert m.draftable(req, ids[:1] + [bad] + ids[1:]) == ids[:1]  # refused at the second token
    # the end is left for the model: xgrammar's after the stop token (EOS), llguidance's with the last token
    drafts = ids if backend.name == "xgrammar" else ids[:-1]
    assert m.draftable(req, ids + [2, 5]) == drafts
    assert m.draftable(req, [bad]) == []
    chunk = ScheduledChunk(req, 1 + len(drafts), drafts)
    masks = m.bitmasks(SchedulerOutput(chunks=[chunk]))["d"]
    assert masks.shape == (len(drafts) + 1, bitmask_words(VOCAB))
    allowed = [{t for t in range(VOCAB) if masks[j, t // 32] >> (t % 32) & 1} for j in range(len(drafts) + 1)]
    assert ids[0] in allowed[0] and bad not in allowed[0]
    for j in range(1, len(drafts) + 1):  # each position allows the choice's next token there
        assert ids[j] in allowed[j] if j < len(ids) else 2 in allowed[j]
    # the matcher is back at the start: the first position's mask again, and the run then advances at once
    assert torch.equal(m.bitmasks(SchedulerOutput(chunks=[ScheduledChunk(req, 1)]))["d"], masks[0])
    run = ids + [2] if backend.name == "xgrammar" else ids
    for token in run:
        req.append_token(token)
    advance = m.advance(req, len(run))
    assert advance.accepted and advance.terminated
    m.release("d")
