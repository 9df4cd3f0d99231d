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
    own, off the interpreter, from the repository root; fails the test on an error; its stdout.
    Triton's own cache of compiled kernels is kept under ember's cache dir (unless
    TRITON_CACHE_DIR says where): Triton names each entry by a hash of the kernel's source and
    what it calls, its constants, signature and options, the target and Triton's own build, so an
    unchanged kernel is not compiled again on each run (ptxas on a cold cache: seconds a kernel)."""
    from ember.paths import cache_dir

    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's `flag` output for `cubin`, kept (gzipped) under ember's cache dir by a hash of the
    cubin, the flag and the tool (Triton's version): a kernel's SASS is dumped once (0.3-0.7 s a
    dump), not again for each check that reads it nor on each run of an unchanged kernel (Triton's
    cache gives back the same cubin)."""
    import gzip
    import hashlib
    import tempfile

    import triton

    from ember.paths import cache_dir

    tool = triton.knobs.nvidia.cuobjdump.path
    key = hashlib.sha256(b"\0".join([cubin, flag.encode(), f"{tool} {triton.__version__}".encode()])).hexdigest()
    kept = cache_dir() / "cuobjdump" / f"{key}.txt.gz"
    if kept.is_file():
        return gzip.decompress(kept.read_bytes()).decode()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=kept.parent, delete=False) as tmp:  # written aside, then renamed
        tmp.write(gzip.compress(out.encode(), compresslevel=1))
    os.replace(tmp.name, kept)
    return out


def sass_text(cubin: bytes) -> str:
    """A compiled kernel's SASS, as the cuobjdump that Triton ships prints it. For scripts run by
    run_compile_script."""
    return _cuobjdump(cubin, "-sass")


def sass_counts(cubin: bytes) -> dict[str, int]:
    """A compiled kernel's registers a thread (REG), stack frame in bytes (STACK: where ptxas spills
    registers; the PTX shows no spill) and spill stores and loads (STL, LDL) in its SASS, from the
    cuobjdump that Triton ships. For scripts run by run_compile_script."""
    import re

    usage, sass = _cuobjdump(cubin, "-res-usage"), sass_text(cubin)
    counts = {key: int(re.search(rf"\b{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK")}
    counts.update({op: len(re.findall(rf"\b{op}(?:\.\w+)*\s", sass)) for op in ("STL", "LDL")})
    return counts


def compile_aligned(kernel, constants: dict, types: dict, options: dict):
    """`kernel` compiled for sm_90 with `constants`, its arguments typed by `types` (other
    pointers "*bf16", other scalars "i32"), each pointer and stride 16-aligned as a launch
    specializes them. For scripts run by run_compile_script."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
               if a.endswith("_ptr") or a.startswith("stride")}
    source = ASTSource(kernel, signature, {(names.index(c),): v for c, v in constants.items()}, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
