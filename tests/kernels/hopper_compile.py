"""Compiling Triton kernels for the H100 / H200 (sm_90) without a GPU: the interpreter runs what a
compiled kernel may refuse (a global that is no constexpr, a variable whose shape changes in a
branch, an integer type a GPU op does not take)."""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# The compile process: it reads a script a line (JSON) on stdin, runs it in a namespace of its own
# as `python -c` would (__name__ "__main__", the repository root its cwd) with its stdout and stderr
# caught, and answers a JSON line {"ok", "stdout", "stderr"} on the stdout it had at its start; what
# C code writes to fd 1 goes to its stderr, off that channel.
_SERVER = r"""
import contextlib, io, json, os, sys, traceback
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    out, err, ok = io.StringIO(), io.StringIO(), True
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(json.loads(line), "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            ok = e.code in (None, 0)
        except BaseException:
            ok = False
            traceback.print_exc()
    reply.write(json.dumps({"ok": ok, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
    reply.flush()
"""
_server: subprocess.Popen | None = None
_server_stderr = None  # the file its stderr goes to


def _compile_process() -> subprocess.Popen:
    """This test process's compile process (started on first use, again if one died), off the
    interpreter, with Triton's cache as run_compile_script says; it ends with this process (_stop)."""
    global _server, _server_stderr
    if _server is None or _server.poll() is not None:
        from ember.paths import cache_dir

        env = dict(os.environ, TRITON_INTERPRET="0")
        env.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))
        _server_stderr = tempfile.TemporaryFile()
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=_server_stderr, text=True, env=env, cwd=ROOT)
        atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    """Ends the compile process with this one: its stdin closes, it finishes its script and exits."""
    server.stdin.close()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()  # this process's own child, by its handle
        server.wait()


def run_compile_script(script: str) -> str:
    """Runs `script` (which calls triton.compile for GPUTarget("cuda", 90, 32)) off the interpreter,
    from the repository root, in a namespace of its own; fails the test on an error; its stdout.
    The scripts of a test process share one compile process (_compile_process): torch and ember
    are imported once (~2.5 s of CPU a script otherwise), not once a script. Triton's own cache of
    compiled kernels is kept under ember's cache dir (unless TRITON_CACHE_DIR says where): Triton
    names each entry by a hash of the kernel's source and what it calls, its constants, signature
    and options, the target and Triton's own build, so an unchanged kernel is not compiled again on
    each run (ptxas on a cold cache: seconds a kernel)."""
    pytest.importorskip("triton.backends.nvidia")
    server = _compile_process()
    server.stdin.write(json.dumps(script) + "\n")
    server.stdin.flush()
    if not select.select([server.stdout], [], [], 600)[0]:
        server.kill()  # this process's own child, by its handle
        server.wait()
        pytest.fail("the compile script ran past 600 s")
    line = server.stdout.readline()
    if not line:  # the compile process died (a crash in the compiler): the next script starts another
        server.wait()
        _server_stderr.seek(0)
        pytest.fail(f"the compile process died ({server.returncode}): {_server_stderr.read()[-3000:].decode()}")
    reply = json.loads(line)
    assert reply["ok"], reply["stderr"][-3000:]
    return reply["stdout"]


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
