"""Incremental detokenization: turn generated ids into text one step at a time.

Decoding all generated ids at every step costs O(n) per token. Instead, decode a small
window of recent tokens and emit only what the newest tokens added:

    tokens:  ...  prefix_offset ........ read_offset ......... len(tokens)
                  |<- already emitted -->|<- new this step -->|
    delta = decode(tokens[prefix_offset:]) minus decode(tokens[prefix_offset:read_offset])

The window starts a few tokens back so that decoders which treat the first token
specially (e.g. dropping a SentencePiece leading space) see the same context as a full
decode. A byte-level token can end in the middle of a UTF-8 character; then the window
decodes to a trailing U+FFFD and the new tokens are held back until the character is whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember.loader.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # how many prompt tokens the first window starts with


class IncrementalDetokenizer:
    """Text deltas for a stream of generated token ids.

    The concatenation of every `add()` result and `flush()` equals
    `tokenizer.decode(token_ids, skip_special_tokens=...)` for byte-level tokenizers.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._all_ids: list[int] = context  # the prompt context, then generated ids
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, self._read_offset)
        self._text_parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """The generated ids so far (no prompt)."""
        return self._all_ids[self._num_context:]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (maybe "")."""
        self._all_ids.extend(new_token_ids)
        window_text = self._decode(self._prefix_offset, len(self._all_ids))
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""  # nothing new (e.g. a skipped special token), or a character is unfinished
        return self._emit(window_text)

    def flush(self) -> str:
        """Whatever is still held back (only ever non-empty when the ids end in an incomplete
        or invalid UTF-8 sequence); call once when the request finishes."""
        window_text = self._decode(self._prefix_offset, len(self._all_ids))
        return self._emit(window_text) if len(window_text) > len(self._prefix_text) else ""

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._all_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._text_parts.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._all_ids[start:end], skip_special_tokens=self._skip_special)
