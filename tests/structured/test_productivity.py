"""Grammars that can never end are refused at the boundary (productivity.py), on the text
xgrammar prints and through both backends; no real grammar is refused (no false
positives); a grammar the checker cannot read is served with jump-forward off."""

from __future__ import annotations

import logging

import pytest
import xgrammar as xgr

from ember.sampling_params import StructuredOutputsParams as S
from ember.structured.productivity import RECURSES, Productivity, check_productivity
from ember.structured.xgrammar_backend import _grammar, read_regex

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value"]}}, "$ref": "#/$defs/node"}

# every constraint the tests use (tests/engine/test_structured_e2e.py, test_async_scheduling.py,
# tests/server/test_structured_server.py, this folder), then more shapes of JSON schema
REAL = [S(json=s) for s in [
    PERSON,
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"title": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
                                      "author": NAME}, "required": ["title", "pages", "author"]},
    {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                  "minItems": 3, "maxItems": 3}}, "required": ["colours"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {"type": "object", "properties": {"light": {"enum": ["red", "amber", "green"]}}, "required": ["light"]},
    {"type": "object", "properties": {"city": NAME, "celsius": {"type": "number", "minimum": -50, "maximum": 50}},
     "required": ["city", "celsius"]},
    {"type": "object", "properties": {"company": NAME, "address": {"type": "object", "properties": {
        "street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"]}}, "required": ["company", "address"]},
    {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": NAME, "price": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["name", "price"]}}}, "required": ["fruits"]},
    {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "review": {"type": "string", "pattern": "^[A-Za-z ,.!']{1,40}$"}},
     "required": ["stars", "review"]},
    {"type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                      "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200}},
     "required": ["sky", "wind_kmh"]},
    {"type": "object", "properties": {"username": {"type": "string", "minLength": 3, "maxLength": 8}},
     "required": ["username"]},
    {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "minItems": 2, "maxItems": 4}}, "required": ["numbers"]},
    {"type": "object", "properties": {"name": NAME, "breed": NAME, "good": {"type": "boolean"}},
     "required": ["name", "breed", "good"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                      "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"make": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "electric": {"type": "boolean"}}, "required": ["make", "year"]},
    {"type": "object", "properties": {"topic": NAME, "attendees": {"type": "array", "items": NAME, "minItems": 1,
                                                                   "maxItems": 2},
                                      "room": {"enum": ["A", "B", "C"]}}, "required": ["topic", "attendees", "room"]},
    {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["label", "confidence"]},
    {"type": "object", "properties": {"country": NAME, "capital": NAME,
                                      "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000}},
     "required": ["country", "capital", "population_millions"]},
    {"type": "object", "properties": {"task": {"type": "string", "minLength": 2, "maxLength": 30}, "done": {"type": "boolean"},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["task", "done", "priority"], "additionalProperties": False},
    {"type": "object", "properties": {
        "student": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]},
        "grades": {"type": "array", "items": {"enum": ["A", "B", "C", "D"]}, "minItems": 1, "maxItems": 3}},
     "required": ["student", "grades"]},
    {"const": {"status": "ok"}},
    # more shapes: free objects and arrays, anyOf / oneOf / allOf, nullable, nested arrays,
    # formats, additionalProperties schemas, and recursion that need not go on (a tree
    # whose children are optional, a linked list ending in null, an array of itself)
    {"type": "object"},
    {"type": "array"},
    {"type": "array", "items": {"type": "array", "items": {"type": "number"}}, "maxItems": 3},
    {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
    {"type": "object", "properties": {"v": {"type": ["string", "null"]}, "when": {"type": "string", "format": "date-time"},
                                      "mail": {"type": "string", "format": "email"}}, "required": ["v", "when"]},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "uniqueItems": True}}},
    TREE,
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"$defs": {"list": {"type": "object", "properties": {"head": {"type": "integer"},
                                                         "tail": {"anyOf": [{"$ref": "#/$defs/list"}, {"type": "null"}]}},
                        "required": ["head", "tail"]}}, "$ref": "#/$defs/list"},
    {"$defs": {"nest": {"type": "array", "items": {"$ref": "#/$defs/nest"}}}, "$ref": "#/$defs/nest"},
]] + [S(regex=r) for r in [
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)", r"\(\d{3}\) \d{3}-\d{4}",
    r"([01]\d|2[0-3]):[0-5]\d", r"\d{4}-\d{2}-\d{2}", r"[A-Z][a-z]{2,8} (is|was) (red|blue)", r"\d{3}",
    r"a{1,100}", r"(ab|c)*d+e?", r"[^\"\\]{0,5}\\n", "x" * 300,
]] + [S(choice=c) for c in [
    ["yes", "no"], ["Paris", "Rome"], ["Rome", "Oslo"], ["yes", "no", "maybe"], ['say "hi"', "back\\slash"],
]] + [S(grammar=g) for g in [
    'root ::= num (op num){1,3}\nop ::= " + " | " - " | " * "\nnum ::= [1-9] [0-9]?',
    'root ::= [1-9] " + " [1-9]',
    'root ::= "(" root ")" | "x"',  # recursive, but it can stop
    'root ::= item+\nitem ::= "a" | "[" root? "]"',
    'root ::= [a-z]* ("," root)?',
    'root ::= x (=("f"))\nx ::= [a-z]* "a"{2,3} ""',
    'root ::= "\\"" [\\]\\\\] "\\x41\\u00e9\\n" "é" [^\\0-\\x1f\\"\\\\\\r\\n]+',
]] + [S(json_object=True)]


def never_ends(rule: str, reason: str = RECURSES) -> Productivity:
    return Productivity("never_ends", rule, reason)


def test_the_checker_reads_xgrammars_normalized_text():
    assert check_productivity('root ::= (("a" root) | (x))\nx ::= (([a-z]* x_1{2, 3} x_2 x_3))\n'
                              'x_1 ::= (("a"))\nx_2 ::= ("" | ("b"))\nx_3 ::= (("e")) (=("f"))') == Productivity("ends")
    # escapes inside strings and classes (a `"` or `]` after a backslash does not close them)
    assert check_productivity('root ::= (("\\"" [^\\0-\\x1f\\"\\\\\\r\\n] "\\\\" [\\]] y{0, -1}))\n'
                              'y ::= (("a"))') == Productivity("ends")
    # a repeat of zero or more can end without its body, but once inside the body the
    # output must end it too: a body that cannot end is refused either way
    assert check_productivity('root ::= ((y{0, -1}))\ny ::= (("a" y))') == never_ends("y")
    assert check_productivity('root ::= ((y{1, -1}))\ny ::= (("a" y))') == never_ends("y")
    # lookaheads are neither output nor followed
    assert check_productivity('root ::= (("a")) (=(z))\nz ::= (("b" z))') == Productivity("ends")
    assert check_productivity('root ::= (("a" root))') == never_ends("root")
    # the rule named is on the cycle, not merely one that leads to it
    assert check_productivity('root ::= (("a" x))\nx ::= (("b" y))\ny ::= (("c" x))') == never_ends("x")
    # a rule that cannot end but cannot be reached does no harm
    assert check_productivity('root ::= (("a"))\nz ::= (("b" z))') == Productivity("ends")


def test_a_class_that_matches_nothing_cannot_end():
    assert check_productivity('root ::= (("a" [^\\0-\\U0010ffff]))') == \
        never_ends("root", "every expansion of it needs [^\\0-\\U0010ffff], which matches nothing")
    assert check_productivity('root ::= (("a" []))').status == "never_ends"
    assert check_productivity('root ::= (([^\\0-\\ud7ff\\ue000-\\U0010ffff]))').status == "never_ends"  # surrogates only
    for cls in ("[^]", "[^\\0-\\U0010fffe]", "[\\]]", "[\\u4e2d-\\u9fa5\\xe9]", "[^\\0-\\x1f\\x21-\\U0010ffff]", "[-]"):
        assert check_productivity(f'root ::= (({cls}))') == Productivity("ends"), cls
    # where the grammar could still end another way, a dead branch is not refused, but
    # jump-forward is not safe on it (`(a+[^\s\S])?b` after "a": only "a" can follow, forever)
    verdict = check_productivity('root ::= ((root_1 "b"))\nroot_1 ::= ("" | (root_2 []))\n'
                                 'root_2 ::= (("a" root_2) | ("a"))')
    assert verdict == Productivity("unknown", reason="rule 'root_1' has a branch that can never end ([] matches nothing)")


def test_a_regex_builtin_is_read_through_its_own_grammar():
    text = 'root ::= (("\\"" root_1 "\\""))\nroot_1 ::= Regex("^[0-9]{5}$", json_string=true)'
    assert check_productivity(text, read_regex=read_regex) == Productivity("ends")
    assert check_productivity(text) == Productivity(
        "unknown", reason='Regex("^[0-9]{5}$") with no way to read a regex')
    nothing = 'root ::= ((root_1))\nroot_1 ::= Regex("^a+[^\\\\0-\\\\U0010ffff]$", json_string=true)'
    assert check_productivity(nothing, read_regex=read_regex) == never_ends(
        "root_1", 'every expansion of it needs Regex("^a+[^\\\\0-\\\\U0010ffff]$"), which matches nothing')


@pytest.mark.parametrize("text,reason", [
    ('root ::= TagDispatch(\n  ("<a>", x),\n  loop_after_dispatch=true\n)\nx ::= (("1"))', "unexpected ',' at offset 30"),
    ('start ::= (("a"))', "no rule 'root'"),
    ('root ::= (("a" nowhere))', "rule 'root' refers to an undefined rule"),
    ('root ::= (("a")\n', "expected ), found the end"),
    ('root ::= (("a"))\nroot ::= (("b"))', "rule 'root' is defined twice"),
    ("", "no rule 'root'"),
    ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "nested too deeply"),
])
def test_text_the_checker_cannot_read_is_unknown_not_an_error(text, reason):
    verdict = check_productivity(text)
    assert verdict.status == "unknown" and verdict.rule is None
    assert verdict.reason.startswith(reason), verdict.reason


@pytest.mark.parametrize("so", REAL, ids=lambda so: f"{so.kind}:{so.key[1][:40]}")
def test_no_real_grammar_is_refused(so, backend):
    assert check_productivity(str(_grammar(so)), read_regex=read_regex) == Productivity("ends")
    try:
        backend.validate(so)
    except ValueError as e:  # llguidance lacks oneOf, uniqueItems, lookaheads, \0: its own refusals
        assert backend.name == "guidance" and "can never end" not in str(e), str(e)


NEVER_ENDS = [
    (S(grammar='root ::= "a" root'), "invalid grammar for structured output: rule 'root' can never end "
                                     "(every expansion of it recurses forever), so no output could complete it"),
    (S(grammar='root ::= "b" | "a" x\nx ::= "a" x'), "invalid grammar for structured output: rule 'x' can never end "
                                                     "(every expansion of it recurses forever), so no output could "
                                                     "complete it"),
    (S(grammar='root ::= "<" items ">"\nitems ::= item ("," item)*\nitem ::= "[" items "]"'),
     "invalid grammar for structured output: rule 'items' can never end (every expansion of it recurses forever), "
     "so no output could complete it"),
    (S(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
     "invalid json for structured output: the schema can never end: a required property or item refers back to a "
     "schema that contains it (rule 'root' of its grammar recurses forever), so no output could complete it"),
    (S(json={"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"}),
     "invalid json for structured output: the schema can never end: a required property or item refers back to a "
     "schema that contains it (rule 'defs_n' of its grammar recurses forever), so no output could complete it"),
    (S(regex=r"ab[^\x00-\U0010FFFF]"),  # a class that matches nothing: jump-forward would hang on `a+[^\s\S]`
     "invalid regex for structured output: rule 'root' of the regex can never end (every expansion of it needs "
     "[^\\0-\\U0010ffff], which matches nothing), so no output could complete it"),
    (S(json={"type": "object", "properties": {"code": {"type": "string", "pattern": r"^a+[^\x00-\U0010FFFF]$"}},
             "required": ["code"]}),
     "invalid json for structured output: rule 'root_prop_0_1' of the schema's grammar can never end (every "
     "expansion of it needs Regex(\"^a+[^\\\\x00-\\\\U0010FFFF]$\"), which matches nothing), so no output could "
     "complete it"),
]


@pytest.mark.parametrize("so,message", NEVER_ENDS, ids=lambda x: x.kind if isinstance(x, S) else "")
def test_a_grammar_that_can_never_end_is_refused_by_validate_and_compile(so, message, backend):
    with pytest.raises(ValueError) as e:
        backend.validate(so)
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:  # the offline path compiles without the boundary
        backend.compile(so)
    assert str(e.value) == message


@pytest.mark.parametrize("so,text,reason", [
    (S(grammar='root ::= "abc" y\ny ::= TagDispatch(("<a>", x))\nx ::= "1"'), "abc<a>1",
     "unexpected ',' at offset 48"),
    # a dead branch: after "abcd" jump-forward would force "d" forever (it is never asked here)
    (S(regex=r"abc(d+[^\x00-\U0010FFFF])?e"), "abce",
     "rule 'root_2' has a branch that can never end ([^\\0-\\U0010ffff] matches nothing)"),
], ids=["tag-dispatch", "dead-branch"])
def test_a_grammar_the_checker_cannot_vouch_for_is_served_with_jump_forward_off(so, text, reason, tok, caplog,
                                                                               xgrammar_backend):
    backend = xgrammar_backend
    assert check_productivity(str(_grammar(so)), read_regex=read_regex) == Productivity("unknown", reason=reason)
    backend.validate(so)
    with caplog.at_level(logging.WARNING, logger="ember.structured.xgrammar_backend"):
        compiled = backend.compile(so)
    assert caplog.messages == [f"the grammar of a {so.kind} constraint could not be checked for rules that never "
                               f"end ({reason}): served with jump-forward off"]
    unchecked = xgr.GrammarMatcher(backend.compiler().compile_grammar(_grammar(so)))
    assert unchecked.find_jump_forward_string() == "abc"  # what jump-forward would have forced at the start
    matcher = compiled.matcher()
    assert matcher.jump_forward() == ""
    ids = tok.encode(text, add_special_tokens=False)
    assert matcher.accept_tokens(ids) == len(ids)  # the grammar itself is served
