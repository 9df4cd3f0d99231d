"""Attention backends behind one contract (base.py), chosen by name."""

from ember.layers.attention.base import AttentionBackend, AttentionMetadata
from ember.layers.attention.torch_ref import TorchReferenceBackend


def _triton_backend() -> AttentionBackend:
    from ember.layers.attention.triton_backend import TritonBackend  # imports triton: CUDA runs only

    return TritonBackend()


_BACKENDS = {"torch": TorchReferenceBackend, "triton": _triton_backend}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
