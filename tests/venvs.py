"""A virtualenv of its own for a library whose pins clash with the test extra's (LlamaIndex's
OpenAI integration pins openai<3; the extra has 3.x): made once under ember's cache dir, named
by a hash of its pinned requirements and this Python's version, and reused. It counts as made
only once its marker is written, after pip succeeded: a half-made one is made again."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember.paths import cache_dir

MARKER = ".ember-installed"


def venv_with(name: str, requirements: list[str], timeout: float = 900) -> Path:
    """The Python of `<cache>/test-venvs/NAME-HASH`, with `requirements` (pinned with ==)
    installed by pip (its global config, the index and constraints, as it is)."""
    assert all("==" in r for r in requirements), requirements
    spec = "\n".join([f"python {sys.version_info.major}.{sys.version_info.minor}", *requirements])
    root = cache_dir() / "test-venvs"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    python = venv / "bin" / "python"
    with open(root / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker at a time (pytest-xdist, two sessions)
        if (venv / MARKER).is_file() and (venv / MARKER).read_text() == spec and python.exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(python), "-m", "pip", "install", "-q", *requirements]):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{' '.join(cmd)} ran past {timeout} s")
            if done.returncode != 0:
                pytest.fail(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        (venv / MARKER).write_text(spec)
    return python
