"""What evaluation harnesses (lm-eval's local-completions, for one) read from the server:
the prompt echoed before a completion with its tokens' logprobs, vLLM's `prompt_logprobs`,
and `GET /tokenizer_info`.

All of it is formatting: the engine computes the logprobs of a request's prompt tokens
(SamplingParams.prompt_logprobs, a dict per position after the first) and this module
writes them in OpenAI's legacy completion shape (echo) or in vLLM's (prompt_logprobs).
"""

from __future__ import annotations

import math
from typing import Any

from ember.loader.tokenizer import Tokenizer
from ember.outputs import Logprob, RequestOutput
from ember.server import protocol as p

MIN_LOGPROB = -9999.0  # what a -inf logprob is written as (vLLM's value): JSON has no infinity


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _text(lp: Logprob | None, token_id: int, tokenizer: Tokenizer | None, as_ids: bool = False) -> str:
    if as_ids:  # vLLM's return_tokens_as_token_ids
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"


def prompt_text(out: RequestOutput, tokenizer: Tokenizer) -> str:
    """The prompt as echoed: its text as given, or its token ids decoded."""
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


def echo(choice: p.CompletionChoice, out: RequestOutput, top: int | None, tokenizer: Tokenizer,
         as_ids: bool = False) -> None:
    """Put the prompt before `choice`'s completion: in its text and, when it has logprobs
    (`top` alternatives per token), as the first entries of each list; the completion's
    text offsets move past the prompt."""
    prompt = prompt_text(out, tokenizer)
    choice.text = prompt + choice.text
    if choice.logprobs is None:
        return
    entries = out.prompt_logprobs or [None]
    head = p.CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(out.prompt_token_ids, entries):
        lp = entry.get(token_id) if entry is not None else None
        text = _text(lp, token_id, tokenizer, as_ids)
        head.tokens.append(text)
        head.text_offset.append(offset)
        offset += len(text)
        head.token_logprobs.append(_finite(lp.logprob) if lp is not None else None)
        head.top_logprobs.append(None if entry is None or not top else
                                 {_text(t, tid, tokenizer, as_ids): _finite(t.logprob) for tid, t in ranked(entry, top)})
    tail = choice.logprobs
    choice.logprobs = p.CompletionLogprobs(
        text_offset=head.text_offset + [len(prompt) + o for o in tail.text_offset],
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        tokens=head.tokens + tail.tokens,
        top_logprobs=head.top_logprobs + tail.top_logprobs)


def ranked(entry: dict[int, Logprob], top: int) -> list[tuple[int, Logprob]]:
    """The `top` most likely tokens of a position, most likely first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= top), key=lambda x: x[1].rank)[:top]


def prompt_logprobs(out: RequestOutput, top: int | None) -> p.PromptLogprobs | None:
    """vLLM's prompt_logprobs of a request that asked for `top` (None: it did not): None for
    the first token, then per position the prompt token and the `top` most likely ones,
    token id -> {logprob, rank, decoded_token}."""
    if top is None or out.prompt_logprobs is None:
        return None
    result: p.PromptLogprobs = []
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
        if entry is None:
            result.append(None)
            continue
        kept = {tid: lp for tid, lp in entry.items() if tid == token_id or lp.rank <= top}
        result.append({tid: p.PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                       for tid, lp in kept.items()})
    return result


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """GET /tokenizer_info as vLLM answers it: the tokenizer's configuration, in the names of
    HF's tokenizer_config.json (what lm-eval's remote tokenizer reads: eos_token, bos_token,
    pad_token, chat_template)."""
    backend = tokenizer.backend

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else backend.id_to_token(token_id)

    added = backend.get_added_tokens_decoder()
    bos = tokenizer.bos_token_id
    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # what transformers builds from a tokenizer.json
        "bos_token": token(bos),
        "eos_token": token(tokenizer.eos_token_id),
        "pad_token": token(tokenizer.pad_token_id),
        "add_bos_token": bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos],
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
        "added_tokens_decoder": {str(i): t.content for i, t in sorted(added.items())},
    }
    if tokenizer.chat_template is not None:
        info["chat_template"] = tokenizer.chat_template
    return info
