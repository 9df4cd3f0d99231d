"""Where ember keeps what it makes: a leaf every layer may import (the CPU kernels' builds, the
default model)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`EMBER_CACHE_DIR`, default `~/.cache/ember`."""
    return Path(os.environ.get("EMBER_CACHE_DIR") or Path.home() / ".cache" / "ember")
