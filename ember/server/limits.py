"""RequestLimits: what one request may ask of the server (`ember serve --max-...`). Each
cap bounds the engine work or memory a single client can take from the others; a request
over one gets 400 (413 for the body) naming the cap. Kept apart from protocol.py so that
the CLI reads the defaults without importing pydantic."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP_CHARS = 1024  # one stop string: streaming holds back len(longest stop) - 1 characters


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

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")

