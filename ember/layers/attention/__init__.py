"""Attention backends behind one contract (base.py), chosen by name."""

from ember.layers.attention.base import AttentionBackend, AttentionMetadata
from ember.layers.attention.torch_ref import TorchReferenceBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchReferenceBackend}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
