"""RequestLimits: what one request may ask of the server (`ember serve --max-...`). Each
cap bounds the engine work or memory a single client can take from the others; a request
over one gets 400 (413 for the body) naming the cap. Kept apart from protocol.py so that
the CLI reads the defaults without importing pydantic."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP_CHARS = 1024  # one stop string: streaming holds back len(longest stop) - 1 characters
MAX_LOGPROBS = 20  # top alternatives one token may ask for (OpenAI's top_logprobs limit; vLLM's --max-logprobs)


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128  # samples per prompt (OpenAI's own limit)
    max_prompts: int = 128  # prompts in one completions request
    max_logit_bias: int = 1024  # logit_bias entries
    max_stop: int = 32  # stop strings (each at most MAX_STOP_CHARS)
    max_choices: int = 512  # guided_choice / structured_outputs.choice options
    # the HTTP request body: parsing JSON holds the interpreter lock, ~40 ms a MiB of numbers
    # on 2 cores, and /health must answer within 100 ms meanwhile; 1 MiB holds a 128k-token
    # prompt as text or 8k-token prompts as ids by the dozen (raise it for more)
    max_body_bytes: int = 1 << 20
    max_logprobs: int = MAX_LOGPROBS  # logprobs / top_logprobs / prompt_logprobs (0: none may be asked)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            least = 0 if name == "max_logprobs" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be at most {MAX_LOGPROBS} (OpenAI's limit); got {self.max_logprobs}")

