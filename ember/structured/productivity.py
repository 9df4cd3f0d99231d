"""Can every rule of a grammar end? A small checker on xgrammar's normalized EBNF text.

Why: a grammar in which some rule reachable from the root has no finite expansion
(`root ::= "a" root`; a JSON schema whose required property refers back to the schema;
the regex `a+[^\\s\\S]`, whose class matches nothing) has prefixes that no output can
complete. On those grammars xgrammar's jump-forward
(`GrammarMatcher.find_jump_forward_string`) can build the forced text forever: it never
returns, cannot be interrupted from Python, and grows the process until the kernel kills
it. So such grammars are refused when the request arrives, and a grammar this checker
cannot vouch for is served with jump-forward off.

The text is what `str(xgr.Grammar)` prints, one rule per line:

    root ::= (("a" root) | (x))
    x ::= (([a-z]* x_1{2, 3} x_2 "" [^\\0-\\x1f\\"\\\\]))
    y ::= (("e")) (=("f"))              a lookahead: it constrains, it is not output
    z ::= Regex("^[0-9]{5}$", json_string=true)      a JSON schema's `pattern`

A rule is *productive* when it has a finite expansion: strings (`""` too) are, and so
are character classes that match some character; a sequence needs all of its parts, a
choice any; `x*`, `x?` and `x{0, n}` are (zero times), `x+` and `x{m, n}` with m > 0
need `x`; lookaheads do not count (and are not followed for reachability); `Regex(p)` is
productive when the grammar of p is (read through `read_regex`). Productivity is the
least fixed point, found with a worklist; reachability is a walk from the root.

Verdicts: "never_ends" when a reachable rule is not productive (the boundary refuses
it). "unknown" when the text cannot be read (a construct a newer xgrammar prints, such
as `TagDispatch(...)`; a reference to an undefined rule; no `root`), and also when every
reachable rule is productive but one has a branch that matches nothing (`(a+[^\\s\\S])?b`:
after "a" only more "a" can follow, and jump-forward would force "a" forever), which
is a strange grammar but not an invalid one. Unknown is served, with jump-forward off.
The checker never raises and never refuses what it cannot read.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Union

# -- the verdict -------------------------------------------------------------------------


@dataclass(frozen=True)
class Productivity:
    """`ends`: every rule reachable from the root can end. `never_ends`: `rule` cannot,
    and `reason` says why (it recurses forever / it needs text nothing matches).
    `unknown`: `reason` says what could not be read or vouched for."""

    status: Literal["ends", "never_ends", "unknown"]
    rule: str | None = None
    reason: str = ""


RECURSES = "every expansion of it recurses forever"

_KIND_NAMES = {"json": "json", "json_object": "json object", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "structural_tag": "structural tag"}


def never_ends_message(kind: str, verdict: Productivity) -> str:
    """The boundary's ValueError text for a constraint (StructuredOutputsParams.kind)
    whose grammar has a rule that can never end, worded for its kind."""
    prefix = f"invalid {_KIND_NAMES.get(kind, kind)} for structured output"
    rule = verdict.rule
    if kind in ("json", "json_object") and verdict.reason == RECURSES:
        return (f"{prefix}: the schema can never end: a required property or item refers back to a schema "
                f"that contains it (rule '{rule}' of its grammar recurses forever), so no output could complete it")
    of = {"json": " of the schema's grammar", "json_object": " of the schema's grammar", "regex": " of the regex",
          "choice": " of the choice"}.get(kind, "")
    return f"{prefix}: rule '{rule}'{of} can never end ({verdict.reason}), so no output could complete it"


# -- the expression tree -----------------------------------------------------------------


@dataclass(frozen=True)
class _Terminal:  # "...", [...] or Regex(...): `ends` unless nothing matches it
    text: str
    ends: bool = True

    @property
    def short(self) -> str:  # for messages: a class can run to hundreds of characters
        return self.text if len(self.text) <= 60 else self.text[:57] + "..."


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Seq:
    items: tuple[_Expr, ...]


@dataclass(frozen=True)
class _Choice:
    options: tuple[_Expr, ...]


@dataclass(frozen=True)
class _Repeat:  # x*, x+, x?, x{m, n}: only the least count matters here
    body: _Expr
    min_count: int


@dataclass(frozen=True)
class _Lookahead:  # (=...): neither output nor a reason to end
    body: _Expr


_Expr = Union[_Terminal, _Ref, _Seq, _Choice, _Repeat, _Lookahead]


class _Unreadable(Exception):
    """The text is not the normalized EBNF this module knows."""


# -- strings and character classes -------------------------------------------------------

_NAMED_ESCAPES = {"0": 0, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
# the code points UTF-8 can encode (no surrogates): what a class's characters come from
_UNIVERSE = ((0, 0xD7FF), (0xE000, 0x10FFFF))


def _decode(body: str) -> list[tuple[int, bool]]:
    """The code points of a string's or class's text, each with whether it was escaped:
    \\n \\t \\0 ..., \\xHH, \\uHHHH, \\UHHHHHHHH, and a backslash before punctuation."""
    out: list[tuple[int, bool]] = []
    i = 0
    while i < len(body):
        if body[i] != "\\":
            out.append((ord(body[i]), False))
            i += 1
            continue
        e = body[i + 1: i + 2]
        if e in _HEX_DIGITS:
            digits = body[i + 2: i + 2 + _HEX_DIGITS[e]]
            if len(digits) != _HEX_DIGITS[e] or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise _Unreadable(f"bad escape {body[i:i + 10]!r}")
            out.append((int(digits, 16), True))
            i += 2 + len(digits)
        elif e in _NAMED_ESCAPES:
            out.append((_NAMED_ESCAPES[e], True))
            i += 2
        elif not e or e.isalnum():
            raise _Unreadable(f"unknown escape {body[i:i + 2]!r}")
        else:
            out.append((ord(e), True))
            i += 2
    return out


def _class_matches_something(body: str) -> bool:
    """Does the class `[body]` match any character? `[]` and `[^\\0-\\U0010ffff]` do not."""
    chars = _decode(body)
    negated = bool(chars) and chars[0] == (ord("^"), False)
    if negated:
        chars = chars[1:]
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(chars):
        lo = hi = chars[i][0]
        if i + 2 < len(chars) and chars[i + 1] == (ord("-"), False):
            hi = chars[i + 2][0]
            i += 3
        else:
            i += 1
        if hi < lo:
            raise _Unreadable(f"the class [{body}] has a backward range")
        ranges.append((lo, hi))
    if not negated:
        return any(lo <= u_hi and hi >= u_lo for lo, hi in ranges for u_lo, u_hi in _UNIVERSE)
    return not all(_covers(ranges, u_lo, u_hi) for u_lo, u_hi in _UNIVERSE)


def _covers(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Do `ranges` together cover every code point in [lo, hi]?"""
    for r_lo, r_hi in sorted(ranges):
        if r_lo > lo:
            return False
        lo = max(lo, r_hi + 1)
        if lo > hi:
            return True
    return lo > hi


# -- reading the text --------------------------------------------------------------------

# one token each: a quoted string or a character class (a backslash escapes the next
# character, so `"\""` and `[\]\\]` end where they should), a name, `::=`, a lookahead's
# `(=`, a repeat's `{m, n}` (n = -1: unbounded), a single punctuation mark
_TOKEN = re.compile(r"""
    \s+
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<define>::=)
  | (?P<look>\(=)
  | (?P<repeat>\{\s*\d+\s*(?:,\s*(?:-?\d+)?\s*)?\})
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<punct>[()|*+?,=])
""", re.VERBOSE | re.DOTALL)
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(-?\d+)?\s*)?\}")
_REGEX = "Regex"  # the built-in `Regex("pattern", json_string=true)` (JSON schemas' `pattern`)


def _tokens(text: str) -> Iterator[tuple[str, str, int]]:
    """(kind, text, offset) of each token; a punctuation mark is its own kind."""
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unreadable(f"unexpected {text[pos:pos + 20]!r} at offset {pos}")
        pos = m.end()
        kind = m.lastgroup
        if kind is None:  # whitespace
            continue
        yield m.group(kind) if kind == "punct" else kind, m.group(kind), m.start()


class _Parser:
    """rules := (name '::=' choice)+ ; choice := seq ('|' seq)* ; seq := item+ ;
    item := atom ('*' | '+' | '?' | '{m, n}')* ;
    atom := string | class | 'Regex(' string (',' name '=' value)* ')' | name | '(' choice ')' | '(=' choice ')'"""

    def __init__(self, text: str, read_regex: Callable[[str], str] | None) -> None:
        self.toks = list(_tokens(text))
        self.pos = 0
        self.read_regex = read_regex
        self.saw_regex = False

    def peek(self, ahead: int = 0) -> str:
        i = self.pos + ahead
        return self.toks[i][0] if i < len(self.toks) else "end"

    def where(self) -> str:
        if self.pos >= len(self.toks):
            return "the end"
        _, text, offset = self.toks[self.pos]
        return f"{text[:20]!r} at offset {offset}"

    def take(self, kind: str) -> str:
        if self.peek() != kind:
            raise _Unreadable(f"expected {kind}, found {self.where()}")
        self.pos += 1
        return self.toks[self.pos - 1][1]

    def rules(self) -> dict[str, _Expr]:
        rules: dict[str, _Expr] = {}
        while self.peek() != "end":
            name = self.take("name")
            self.take("define")
            if name in rules:
                raise _Unreadable(f"rule {name!r} is defined twice")
            rules[name] = self.choice()
        if self.saw_regex and _REGEX in rules:
            raise _Unreadable(f"a rule named {_REGEX!r} and the built-in {_REGEX}(...)")
        return rules

    def choice(self) -> _Expr:
        options = [self.seq()]
        while self.peek() == "|":
            self.take("|")
            options.append(self.seq())
        return options[0] if len(options) == 1 else _Choice(tuple(options))

    def seq(self) -> _Expr:
        items = []
        # a sequence ends at `|`, `)`, the end, or the next rule's `name ::=`
        while self.peek() not in ("|", ")", "end") and not (self.peek() == "name" and self.peek(1) == "define"):
            items.append(self.item())
        if not items:
            raise _Unreadable(f"empty sequence before {self.where()}")
        return items[0] if len(items) == 1 else _Seq(tuple(items))

    def item(self) -> _Expr:
        expr = self.atom()
        while self.peek() in ("*", "+", "?", "repeat"):
            kind = self.peek()
            text = self.take(kind)
            if kind == "repeat":
                m = _REPEAT.fullmatch(text)
                assert m is not None
                low, high = int(m.group(1)), m.group(2)
                if high is not None and int(high) != -1 and int(high) < low:
                    raise _Unreadable(f"the repeat {text} has max < min")
                expr = _Repeat(expr, low)
            else:
                expr = _Repeat(expr, 1 if kind == "+" else 0)
        return expr

    def atom(self) -> _Expr:
        kind = self.peek()
        if kind == "string":
            return _Terminal(self.take(kind))
        if kind == "cls":
            text = self.take(kind)
            return _Terminal(text, ends=_class_matches_something(text[1:-1]))
        if kind == "name" and self.toks[self.pos][1] == _REGEX and self.peek(1) == "(" and self.peek(2) == "string":
            return self.regex()
        if kind == "name":
            return _Ref(self.take(kind))
        if kind in ("(", "look"):
            self.take(kind)
            body = self.choice()
            self.take(")")
            return _Lookahead(body) if kind == "look" else body
        raise _Unreadable(f"unexpected {self.where()}")

    def regex(self) -> _Terminal:
        """Regex("pattern", key=value, ...): a terminal that ends when the pattern's own
        grammar does."""
        self.take("name")
        self.take("(")
        quoted = self.take("string")
        while self.peek() == ",":
            self.take(",")
            self.take("name")
            self.take("=")
            self.take("name" if self.peek() == "name" else "string")
        self.take(")")
        self.saw_regex = True
        text = f"{_REGEX}({quoted})"
        if self.read_regex is None:
            raise _Unreadable(f"{text} with no way to read a regex")
        verdict = _regex_verdict("".join(chr(c) for c, _ in _decode(quoted[1:-1])), self.read_regex)
        if verdict.status == "unknown":
            raise _Unreadable(f"{text}: {verdict.reason}")
        return _Terminal(text, ends=verdict.status == "ends")


@functools.lru_cache(maxsize=256)  # a schema repeats its patterns (one per property that has it)
def _regex_verdict(pattern: str, read_regex: Callable[[str], str]) -> Productivity:
    try:
        ebnf = read_regex(pattern)
    except Exception as e:
        return Productivity("unknown", reason=f"the regex {pattern!r} could not be read: {e}")
    return check_productivity(ebnf)


# -- the analysis ------------------------------------------------------------------------


def _leaves(expr: _Expr) -> Iterator[_Terminal | _Ref]:
    """The terminals and rule references in an expression (not inside lookaheads)."""
    if isinstance(expr, (_Terminal, _Ref)):
        yield expr
    elif isinstance(expr, (_Seq, _Choice)):
        for part in expr.items if isinstance(expr, _Seq) else expr.options:
            yield from _leaves(part)
    elif isinstance(expr, _Repeat):
        yield from _leaves(expr.body)


def _refs(expr: _Expr) -> Iterator[str]:
    """The rules an expression refers to (not inside lookaheads)."""
    return (leaf.name for leaf in _leaves(expr) if isinstance(leaf, _Ref))


def _dead_terminals(expr: _Expr) -> Iterator[_Terminal]:
    """The terminals in an expression that nothing matches (not inside lookaheads)."""
    return (leaf for leaf in _leaves(expr) if isinstance(leaf, _Terminal) and not leaf.ends)


def _ends(expr: _Expr, productive: set[str]) -> bool:
    """Has `expr` a finite expansion, given the rules known to have one?"""
    if isinstance(expr, _Terminal):
        return expr.ends
    if isinstance(expr, _Lookahead):
        return True
    if isinstance(expr, _Ref):
        return expr.name in productive
    if isinstance(expr, _Seq):
        return all(_ends(item, productive) for item in expr.items)
    if isinstance(expr, _Choice):
        return any(_ends(option, productive) for option in expr.options)
    return expr.min_count == 0 or _ends(expr.body, productive)


def check_productivity(text: str, root: str = "root",
                       read_regex: Callable[[str], str] | None = None) -> Productivity:
    """Read xgrammar's normalized EBNF `text` and say whether every rule reachable from
    `root` can end. `read_regex(pattern)` gives the normalized EBNF of a regex (for the
    `Regex(...)` built-in; without it such grammars are "unknown"). Never raises: text it
    cannot read gives status "unknown"."""
    try:
        return _check(_Parser(text, read_regex).rules(), root)
    except _Unreadable as e:
        return Productivity("unknown", reason=str(e))
    except RecursionError:  # parentheses nested deeper than Python's stack
        return Productivity("unknown", reason="nested too deeply")


def _check(rules: dict[str, _Expr], root: str) -> Productivity:
    if root not in rules:
        return Productivity("unknown", reason=f"no rule {root!r}")
    refs = {name: set(_refs(body)) for name, body in rules.items()}
    for name, targets in refs.items():
        if not targets <= rules.keys():
            return Productivity("unknown", reason=f"rule {name!r} refers to an undefined rule")

    # productive rules: the least fixed point. A rule is looked at again only when one of
    # the rules it refers to has just become productive.
    users: dict[str, list[str]] = {name: [] for name in rules}
    for name, targets in refs.items():
        for target in targets:
            users[target].append(name)
    productive: set[str] = set()
    work = deque(rules)
    while work:
        name = work.popleft()
        if name in productive or not _ends(rules[name], productive):
            continue
        productive.add(name)
        work.extend(user for user in users[name] if user not in productive)

    # reachable from the root
    reachable, stack = {root}, [root]
    while stack:
        for target in refs[stack.pop()]:
            if target not in reachable:
                reachable.add(target)
                stack.append(target)

    stuck = [name for name in rules if name in reachable and name not in productive]
    if stuck:
        # Name the culprit: a rule that cannot end refers to another that cannot, or needs
        # a terminal nothing matches (else it could end). Following such references from
        # the first one comes back round (a cycle: named where it closes) or stops at a
        # rule that needs a dead terminal.
        seen: set[str] = set()
        name = stuck[0]
        while name not in seen:
            seen.add(name)
            nxt = next((t for t in _refs(rules[name]) if t not in productive), None)
            if nxt is None:
                dead = next(_dead_terminals(rules[name]), None)
                return Productivity("never_ends", name, f"every expansion of it needs {dead.short}, which "
                                                        f"matches nothing" if dead else "it has no expansion")
            name = nxt
        return Productivity("never_ends", name, RECURSES)
    for name in rules:
        dead = next(_dead_terminals(rules[name]), None) if name in reachable else None
        if dead is not None:
            return Productivity("unknown", reason=f"rule {name!r} has a branch that can never end "
                                                  f"({dead.short} matches nothing)")
    return Productivity("ends")
