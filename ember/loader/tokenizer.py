"""The tokenizer: text <-> token ids, and chat messages -> prompt text.

One `Tokenizer` class wraps a `tokenizers.Tokenizer`, built either from a GGUF file's
metadata (llama.cpp's key names; gguf_tokenizer.py) or from an HF model directory
(tokenizer.json); `load_tokenizer` (tokenizer_files.py) picks by the path.

    tok = load_tokenizer("model.gguf")
    ids = tok.encode("Hello world")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import tokenizers
from tokenizers import processors


class Tokenizer:
    """Encode/decode with a `tokenizers.Tokenizer`, plus the model's special ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        eos = {eos_token_id} if eos_token_id is not None else set()
        self._eos_token_ids = frozenset(eos | set(extra_eos_token_ids))
        self._pad_token_id = pad_token_id
        self._chat_template = chat_template
        self._vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token covers: its vocabulary entry's
        length (byte-level and SentencePiece entries are at least as long as their text),
        doubled when a normalizer may shrink the text first. A text longer than n times this
        has more than n tokens, without tokenizing it."""
        longest = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (2 if self.backend.normalizer is not None else 1)

    # -- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>")
        become their ids. `add_special_tokens` adds BOS/EOS only where the model asks for it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: both texts under the tokenizer's pair template ([CLS] a
        [SEP] b [SEP], <s> a </s></s> b </s>) and each token's segment (the second text's: 1
        where the template says so)."""
        enc = self.backend.encode(first, second, add_special_tokens=True)
        return enc.ids, enc.type_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens = [self.backend.id_to_token(i) for i in ids]
        if None in tokens:
            bad = [i for i, t in zip(ids, tokens) if t is None]
            raise ValueError(f"token ids {bad} are outside the vocabulary (size {self.vocab_size})")
        return tokens  # type: ignore[return-value]

    # -- special tokens -----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: EOS plus end-of-turn ids the model names."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @cached_property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # -- chat ---------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` into prompt text with the model's Jinja chat template (or
        `chat_template`, another template's source), with the variables HF templates expect
        (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`, and any extra
        keyword). `continue_final_message`: the text ends with the last message's content, so
        that the answer continues it (as transformers cuts it)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: pass add_generation_prompt=False")
        variables = {
            "bos_token": self._token_text(self._bos_token_id) or "",
            "eos_token": self._token_text(self._eos_token_id) or "",
            **kwargs,
        }
        template = self._compiled_template if chat_template is None else _compiled(chat_template)
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               **variables)
        return _open_final_message(text, messages) if continue_final_message else text

    @cached_property
    def _compiled_template(self) -> Any:
        if self._chat_template is None:
            raise ValueError(
                "this model has no chat template, so chat messages cannot be turned into a "
                "prompt: pass a plain text prompt instead (completions, not chat)"
            )
        return _compiled(self._chat_template)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    return _jinja_env().from_string(source)


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """`text` cut right after the last message's content (where the template writes it with
    its spaces, or stripped), so that what follows continues that message."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text content to continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's content "
                         "as it is, so it cannot be continued")
    kept = final.lstrip()
    if text[at:at + len(kept)] == kept:  # the template keeps trailing spaces
        return text[:at + len(kept)]
    return text[:at + len(final.strip())]


def _generation_tag() -> type:
    import jinja2.ext
    from jinja2 import nodes

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's part of a
        template with it (to build masks for training); rendering a prompt, it is its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationTag


def _jinja_env() -> Any:
    """A sandboxed Jinja environment with the conventions HF chat templates are written for."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters ('<' -> \u003c); templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """A post-processor that writes `bos $A eos` (either end optional)."""
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B", *tail],
        special_tokens=[t for t in (bos, eos) if t],
    )
