"""What the server does with each request field it has no use of its own for: OpenAI's
fields that change nothing here are accepted (and logged once each), and every field that
would change the output but that ember does not do is refused with 400 by name, with what
to do instead. (A field in no schema, OpenAI's, vLLM's or SGLang's, is refused as unknown.)
The fields ember honours are on the request models (protocol.py) and honoured there."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ember.server")

# OpenAI's fields that do not change what ember generates, and why
NO_EFFECT: dict[str, str] = {
    "metadata": "ember keeps no completions to tag",
    "store": "ember keeps no completions (as if store were false)",
    "service_tier": "ember serves every request at one tier",
    "user": "ember keeps no per-user records",
    "safety_identifier": "ember keeps no per-user records",
    "prompt_cache_key": "ember's prefix cache matches prompts by their tokens, whatever the key",
    "prompt_cache_retention": "ember's prefix cache keeps blocks until their space is needed",
    "prediction": "a predicted output only speeds up OpenAI's decoding; ember decodes as usual",
    "include_obfuscation": "ember's stream chunks carry no obfuscation padding",
    # vLLM's
    "spaces_between_special_tokens": "ember decodes with the model's fast tokenizer, which puts no space between "
                                     "special tokens either way (as vLLM's fast detokenizer)",
    # Anthropic's (the Messages API)
    "cache_control": "ember's prefix cache is automatic: every prompt's blocks are cached",
    "speed": "ember serves every request at one speed",
    "inference_geo": "ember runs where it is started",
    "diagnostics": "ember reports no prompt-cache diagnostics",
    "user_profile_id": "ember keeps no per-user records",
    "workspace_id": "ember has no workspaces",
}


@dataclass(frozen=True)
class Refusal:
    accepts: Callable[[Any], bool]  # the values that ask only for what ember does anyway
    why: str


def _off(value: Any) -> bool:
    return value in (None, False, {}, [])


REFUSED: dict[str, Refusal] = {
    # OpenAI's
    "audio": Refusal(_off, "ember generates text only: drop audio"),
    "modalities": Refusal(lambda v: v in (None, ["text"]), "ember generates text only: send modalities ['text']"),
    "web_search_options": Refusal(_off, "ember has no web search"),
    "functions": Refusal(_off, "the deprecated functions field is not supported: send tools"),
    "function_call": Refusal(_off, "the deprecated function_call field is not supported: send tool_choice"),
    "verbosity": Refusal(lambda v: v in (None, "medium"), "ember cannot steer a model's verbosity"),
    # vLLM's
    "use_beam_search": Refusal(_off, "beam search is not supported: sample n completions instead"),
    "length_penalty": Refusal(lambda v: v in (None, 1, 1.0), "length_penalty applies to beam search, which ember "
                                                           "does not do"),
    "logits_processors": Refusal(_off, "ember runs no custom logits processors"),
    "vllm_xargs": Refusal(_off, "ember runs no custom logits processors to take them"),
    "mm_processor_kwargs": Refusal(_off, "a completion prompt takes no images: send the images and "
                                         "mm_processor_kwargs in a chat request"),
    "kv_transfer_params": Refusal(_off, "ember does no disaggregated prefill"),
    "thinking_token_budget": Refusal(lambda v: v is None, "it applies to chat completions, where the reasoning "
                                                          "parser knows where the reasoning ends"),
    # SGLang's
    "lora_path": Refusal(_off, "ember serves no LoRA adapters"),
    "custom_logit_processor": Refusal(_off, "ember runs no custom logits processors"),
    "session_params": Refusal(_off, "ember has no sessions: send the conversation"),
}

RULED = frozenset(NO_EFFECT) | frozenset(REFUSED)

_logged: set[str] = set()
_lock = threading.Lock()


def refused(given: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) for the first refused value among the fields a request set (by
    name); each no-effect field is logged the first time a request sets it."""
    for name, value in given.items():
        refusal = REFUSED.get(name)
        if refusal is not None and not refusal.accepts(value):
            return name, f"{name} is not supported: {refusal.why}"
        if name in NO_EFFECT and not _off(value):
            with _lock:
                first = name not in _logged
                _logged.add(name)
            if first:
                logger.info("request field %s: accepted, no effect (%s)", name, NO_EFFECT[name])
    return None
