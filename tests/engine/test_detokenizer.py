"""Incremental detokenization equals a full decode, and never shows half a character."""

from __future__ import annotations

import random

import pytest

from ember.engine.detokenizer import IncrementalDetokenizer
from ember.loader.default_model import fetch_default_model
from ember.loader.tokenizer import Tokenizer
from ember.loader.tokenizer_files import load_tokenizer

TEXTS = [
    "Hello world",
    "  two leading spaces and trailing   ",
    "line one\nline two\n\n\tindented",
    "12345 and 3.14",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n",
    "emoji 👋🏽 and family 👨‍👩‍👧‍👦 and flag 🏳️‍🌈",
    "你好，世界！日本語のテキスト",
    "e\u0301 n\u0303 a\u0308 (combining marks) and Å",
    "<|im_start|>assistant\nSure! 🎉<|im_end|>\n<|endoftext|>",
    "🎨🎨🎨",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(fetch_default_model())


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[pos:pos + size]))
        pos += size
    assert pos == len(ids)
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tok: Tokenizer, text: str, skip_special_tokens: bool) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = _stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""
    assert detok.token_ids == ids
    assert detok.text == "".join(deltas)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks(tok: Tokenizer, text: str, seed: int) -> None:
    ids = tok.encode(text)
    rng = random.Random(seed)
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(0, 4), len(ids) - sum(chunks)))  # 0: an empty step
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Wave 👋"}]))
    ids = tok.encode(" Hello 👋🏽 there\n")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas = _stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == " Hello 👋🏽 there\n"
    assert detok.token_ids == ids


def test_emoji_comes_out_whole(tok: Tokenizer) -> None:
    ids = tok.encode("👋🎨")
    assert ids == [10813, 235, 229, 10813, 232, 118]
    assert tok.decode(ids[:1]) == "\ufffd"  # a lone byte-level piece is not a character
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", "👋", "", "", "🎨"]


def test_incomplete_tail_is_held_until_flush(tok: Tokenizer) -> None:
    ids = tok.encode("a👋")[:-1]  # stop in the middle of the emoji's bytes
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["a", "", ""]
    assert detok.flush() == "\ufffd" == tok.decode(ids)[1:]
    assert detok.text == tok.decode(ids)


def test_window_stays_small(tok: Tokenizer) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 🎨 " * 40)
    widths: list[int] = []

    class Recording(Tokenizer):
        def decode(self, ids, skip_special_tokens=False):  # type: ignore[override]
            widths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    recording = Recording(tok.backend, bos_token_id=1, eos_token_id=2)
    detok = IncrementalDetokenizer(recording)
    _stream(detok, ids, [1] * len(ids))
    assert detok.text == tok.decode(ids)
    assert len(ids) > 400 and max(widths) <= 8  # O(window) per token, not O(n)
