"""SGLang's shapes of a request and its result: its sampling parameters (the
`sampling_params` dict: max_new_tokens, regex, json_schema, ...) as ember's SamplingParams,
and a RequestOutput's finish reason and logprobs as SGLang's meta_info writes them. What
SGLang's native `/generate` takes and returns (server/sglang_api.py) and what ember.lang's
programs ask for, one mapping for both, so a program gives the same tokens in-process and
over HTTP. A name ember does not honour is refused by name, never dropped."""

from __future__ import annotations

import json
from typing import Any

from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams, StructuredOutputsParams

# SGLang's name -> SamplingParams' (the same meaning)
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output",
           "sampling_seed": "seed"}
SAME = ("n", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "logit_bias")
CONSTRAINTS = {"regex": "regex", "json_schema": "json", "ebnf": "grammar", "structural_tag": "structural_tag"}
# SGLang's names taken at the value that is ember's behaviour (or, where that is None, at a value
# that asks for nothing: no stop regexes), refused at any other
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
        asks_nothing = value == default if default is not None else value in (None, (), [], "", {})
        if not asks_nothing and value is not None:
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


def finish_reason(out: RequestOutput) -> dict[str, Any] | None:
    """SGLang's finish_reason of a request's sample: {"type": "stop", "matched": the stop
    string or token id} or {"type": "length", "length": its tokens}."""
    sample = out.outputs[0]
    if sample.finish_reason == "length":
        return {"type": "length", "length": len(sample.token_ids)}
    if sample.finish_reason == "stop":
        matched = sample.stop_reason if sample.stop_reason is not None else \
            (sample.token_ids[-1] if sample.token_ids else None)
        return {"type": "stop", "matched": matched}
    return None if sample.finish_reason is None else {"type": sample.finish_reason}


def token_logprobs(out: RequestOutput, with_text: bool, top_n: int) -> tuple[list, list]:
    """(output_token_logprobs, output_top_logprobs) in SGLang's tuples: (logprob, id, text or None)."""
    sample = out.outputs[0]
    chosen, tops = [], []
    for token, entry in zip(sample.token_ids, sample.logprobs or []):
        lp = entry[token]
        chosen.append((lp.logprob, token, lp.decoded_token if with_text else None))
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top_n]
        tops.append([(e.logprob, t, e.decoded_token if with_text else None) for t, e in ranked])
    return chosen, tops
