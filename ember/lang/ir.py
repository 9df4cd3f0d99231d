"""The expressions a program appends to its state (`s += "text" + gen("x")`), as SGLang's
frontend names them: constant text, gen, select, role and variable-scope markers, and lists
of them (what `+` makes). Checks that need no model run here, when the expression is made:
a bad regex or JSON schema raises at `gen()`, before any request."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ember.lang.choices import ChoicesSamplingMethod

# what `dtype` asks for, as SGLang's frontend constrains it
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
DTYPE_REGEX = {int: REGEX_INT, "int": REGEX_INT, float: REGEX_FLOAT, "float": REGEX_FLOAT, bool: REGEX_BOOL,
               "bool": REGEX_BOOL, str: REGEX_STR, "str": REGEX_STR}

# the sampling fields a gen may set (SGLang's names; ember.sglang_params maps them)
SAMPLING_FIELDS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
                   "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "regex", "json_schema")
# what a gen returns besides its text (its meta_info)
LOGPROB_FIELDS = ("return_logprob", "top_logprobs_num", "return_text_in_logprobs")


class Expr:
    """Something a program appends to its state; `a + b` is their list."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList(_items(self) + _items(as_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList(_items(as_expr(other)) + _items(self))


def as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(f"a program appends text or expressions (gen, select, roles); got {type(value).__name__}")


def _items(expr: Expr) -> list[Expr]:
    return list(expr.exprs) if isinstance(expr, ExprList) else [expr]


@dataclass(eq=False)
class ExprList(Expr):
    exprs: list[Expr]


@dataclass(eq=False)
class Constant(Expr):
    value: str


@dataclass(eq=False)
class Gen(Expr):
    """A model call whose output is appended and kept as variable `name`. `sampling`: the
    fields it sets (SGLang's names), over the run's defaults; `logprobs`: what its meta_info
    carries."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    method: ChoicesSamplingMethod


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class CommitPrefix(Expr):
    """Tokenize the state's text so far, so that fork's children share its tokens: their calls
    then share its blocks, which the scheduler computes once (a child whose first uncached block
    another child computes in the same step waits a step and finds it cached)."""


@dataclass(eq=False)
class Concatenate(Expr):
    """join("concate_and_append"): the children's text since the fork, appended in order."""

    states: list[Any]


def gen_expr(name: str | None, sampling: dict[str, Any], logprobs: dict[str, Any], dtype: Any) -> Gen:
    """A Gen whose constraint (regex, json_schema, dtype) is checked now."""
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if dtype is not None:
        if dtype not in DTYPE_REGEX:
            raise ValueError(f"gen dtype must be one of int, float, bool, str; got {dtype!r}")
        if "regex" in sampling or "json_schema" in sampling:
            raise ValueError("gen takes one of dtype, regex and json_schema")
        sampling["regex"] = DTYPE_REGEX[dtype]
    if "regex" in sampling:
        if "json_schema" in sampling:
            raise ValueError("gen takes one of regex and json_schema")
        try:
            re.compile(sampling["regex"])
        except (re.error, TypeError) as e:
            raise ValueError(f"gen regex {sampling['regex']!r} is not a valid regular expression: {e}") from None
    if "json_schema" in sampling:
        sampling["json_schema"] = schema_text(sampling["json_schema"])
    return Gen(name, sampling, {k: v for k, v in logprobs.items() if v is not None})


def schema_text(schema: Any) -> str:
    """A JSON schema given as text, a dict or a pydantic model class, as JSON text."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"gen json_schema is not valid JSON: {e}") from None
    else:
        value = schema
    if not isinstance(value, dict):
        raise ValueError("gen json_schema must be a JSON schema object: its text, a dict or a pydantic model class")
    return schema if isinstance(schema, str) else json.dumps(schema)
