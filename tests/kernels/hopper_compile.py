"""Compiling Triton kernels for the H100 / H200 (sm_90) without a GPU: the interpreter runs what a
compiled kernel may refuse (a global that is no constexpr, a variable whose shape changes in a
branch, an integer type a GPU op does not take)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_compile_script(script: str) -> str:
    """Runs `script` (which calls triton.compile for GPUTarget("cuda", 90, 32)) in a process of its
    own, off the interpreter, from the repository root; fails the test on an error; its stdout."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
