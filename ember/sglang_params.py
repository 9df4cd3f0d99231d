"""SGLang's sampling parameters (its `sampling_params` dict: max_new_tokens, regex,
json_schema, ...) as ember's SamplingParams: what SGLang's native `/generate` takes
(server/sglang_api.py) and what ember.lang's programs ask for, one mapping for both so a
program gives the same tokens in-process and over HTTP. A name ember does not honour is
refused by name, never dropped."""

from __future__ import annotations

import json
from typing import Any

from ember.sampling_params import SamplingParams, StructuredOutputsParams

# SGLang's name -> SamplingParams' (the same meaning)
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output",
           "sampling_seed": "seed"}
SAME = ("n", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "logit_bias")
CONSTRAINTS = {"regex": "regex", "json_schema": "json", "ebnf": "grammar", "structural_tag": "structural_tag"}
# SGLang's names taken at the value that is ember's behaviour, refused at any other
AT_DEFAULT = {"spaces_between_special_tokens": True, "stream_interval": None, "custom_params": None,
              "stop_regex": None}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


def sampling_params_from_sglang(fields: dict[str, Any] | None) -> SamplingParams:
    """SamplingParams for SGLang's `sampling_params` dict; ValueError naming a field ember does
    not take (or takes only at its default) and the fix."""
    fields = dict(fields or {})
    unknown = sorted(set(fields) - set(RENAMED) - set(SAME) - set(CONSTRAINTS) - set(AT_DEFAULT))
    if unknown:
        raise ValueError(f"sampling_params field(s) {', '.join(unknown)} are not supported by ember: leave them out")
    for name, default in AT_DEFAULT.items():
        value = fields.pop(name, None)
        if value is not None and value != default:
            raise ValueError(f"sampling_params.{name} is not supported by ember (only {default!r}): leave it out")
    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_NEW_TOKENS}
    constraint = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name in CONSTRAINTS:
            constraint[CONSTRAINTS[name]] = value
        elif name == "logit_bias":
            kwargs[name] = {int(k): float(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif name == "stop_token_ids":
            kwargs[name] = list(value)
        else:
            kwargs[RENAMED.get(name, name)] = value
    if len(constraint) > 1:
        raise ValueError(f"sampling_params takes one of regex, json_schema, ebnf and structural_tag; got "
                         f"{', '.join(sorted(constraint))}")
    if constraint:
        (kind, value), = constraint.items()
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError("sampling_params.json_schema must be a JSON schema (its text or a dict)")
        if kind == "structural_tag" and isinstance(value, dict):
            value = json.dumps(value)
        kwargs["structured_outputs"] = StructuredOutputsParams(**{kind: value})
    return SamplingParams(**kwargs)
