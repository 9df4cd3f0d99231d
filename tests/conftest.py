"""Shared fixtures: the default model, ember on it, and HF transformers on the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from ember.loader.default_model import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="session")
def llm(gguf_path):
    from ember import LLM

    return LLM(str(gguf_path))


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """HF transformers' own GGUF loading (dequantized to float32): the reference."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
