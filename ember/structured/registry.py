"""Grammar backends by name: `--structured-outputs-backend xgrammar|guidance` (llguidance,
SGLang's `--grammar-backend` name, is guidance). Each is
imported on first use, so the engine needs neither package unless a request asks."""

from __future__ import annotations

from ember.loader.tokenizer import Tokenizer
from ember.structured.base import GrammarBackend, UnavailableBackend

BACKENDS = ("xgrammar", "guidance", "llguidance")
_PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance", "llguidance": "llguidance"}


def make_backend(name: str, tokenizer: Tokenizer | None, vocab_size: int) -> GrammarBackend:
    """The backend `name` for this tokenizer; `vocab_size` is the model's logits width."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if tokenizer is None:
        return UnavailableBackend(name, "the model has no tokenizer")
    try:
        if name == "xgrammar":
            from ember.structured.xgrammar_backend import XGrammarBackend as cls
        else:
            from ember.structured.guidance_backend import GuidanceBackend as cls
    except ImportError as e:
        return UnavailableBackend(name, f"{e} (pip install {_PACKAGES[name]}, or `pip install -e '.[structured]'`)")
    return cls(tokenizer, vocab_size)
