"""The tokenizer and both grammar backends on it, built once for tests/structured."""

from __future__ import annotations

import pytest

from ember.loader.tokenizer_files import load_tokenizer
from ember.structured.registry import make_backend

VOCAB = 49152  # SmolLM2's logits width


@pytest.fixture(scope="session")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="session", params=["xgrammar", "guidance"])
def backend(request, tok):
    return make_backend(request.param, tok, VOCAB)


@pytest.fixture(scope="session")
def xgrammar_backend(tok):
    return make_backend("xgrammar", tok, VOCAB)
