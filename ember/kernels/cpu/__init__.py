"""C++ kernels for the CPU, where plain torch spends its time on gathers, copies and tiny
ops (one decode step of SmolLM2 at batch 16 spent ~13 ms of ~47 ms in paged attention).

The library is compiled on first use with the system C++ compiler against the installed
torch (about 10 s), once per machine: the .so is kept under `EMBER_CACHE_DIR/cpu_kernels`,
named by a hash of the sources, torch's version and the CPU's flags. Without a compiler,
or with EMBER_CPU_KERNELS=0, `ops()` is None and the callers use plain torch.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
HEADERS = [_HERE / "convert.h", _HERE / "quant.h", _HERE / "pool.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20", "-w"]
# the quantized kernels keep IEEE arithmetic (their activation rounding must be the tests'
# torch reference's, bit for bit); their SIMD rows build once per instruction set, and
# quant_gemm.cpp picks one by what the CPU has when it runs
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _objects() -> list[tuple[Path, str, list[str]]]:
    """(source, object name, flags beyond FLAGS) for each object the library links."""
    objects = [(_HERE / "paged_attention.cpp", "paged_attention", ["-ffp-contract=off"]),
               (_HERE / "fused.cpp", "fused", ["-ffast-math"]),
               (_HERE / "quant_gemm.cpp", "quant_gemm", ["-DEMBER_QUANT_X86"] if _X86 else []),
               (_HERE / "quant_repack.cpp", "quant_repack", []),
               (_HERE / "quant_prologue.cpp", "quant_prologue", ["-ffast-math"])]
    if _X86:
        objects += [(_HERE / "quant_simd.cpp", "quant_avx2", ["-march=x86-64-v3"]),
                    (_HERE / "quant_simd.cpp", "quant_avx512",
                     ["-march=x86-64-v4", "-mavx512vnni", "-DEMBER_QUANT_AVX512"])]
    return objects

_enabled = True


@functools.cache
def ops():
    """`torch.ops.ember_cpu` once built and loaded; None where it can't be (logged once)."""
    return _load()


def for_tensor(x: torch.Tensor):
    """The ops, where they apply to x: a CPU tensor of a float dtype they were built for."""
    if not _enabled or x.device.type != "cpu" or x.dtype not in DTYPES:
        return None
    return ops()


@contextmanager
def disabled():
    """Plain torch inside the block: the reference the kernels are tested against."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _load():
    if os.environ.get("EMBER_CPU_KERNELS", "1") == "0":
        return None
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, plain torch is used instead: %s", exc)
        return None
    return torch.ops.ember_cpu


def _build() -> Path:
    from ember.paths import cache_dir

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    key = hashlib.sha256()
    objects = _objects()
    # the sources by content and name, not by where the checkout is: a second checkout (a worktree,
    # a CI runner's fresh path) of the same sources uses the same build
    named = [(src.name, name, extra) for src, name, extra in objects]
    for part in [p.read_bytes() for p in sorted({src for src, _, _ in objects}) + HEADERS] + [
            torch.__version__.encode(), repr([FLAGS, abi, named]).encode(), _cpu_flags().encode()]:
        key.update(part)
    folder = cache_dir() / "cpu_kernels"
    lib = folder / f"ember_cpu_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    # one build at a time: processes that start together (pytest -n workers, tensor-parallel ranks)
    # wait for the first one's library instead of each compiling it beside the others on the same CPUs
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        return _compile(objects, abi, folder, lib)


def _compile(objects: list[tuple[Path, str, list[str]]], abi: str, folder: Path, lib: Path) -> Path:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: safe for parallel builds
        outputs = [Path(tmp) / f"{name}.o" for _, name, _ in objects]
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        compiles = [subprocess.Popen([compiler, *FLAGS, *extra, abi, *includes, "-c", str(src), "-o", str(obj)],
                                     stderr=subprocess.PIPE, text=True)
                    for (src, _, extra), obj in zip(objects, outputs)]
        link = [compiler, "-shared", "-fopenmp", *map(str, outputs), "-o", str(Path(tmp) / lib.name),
                *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu", "-ltorch"]
        for compile_ in compiles:  # the sources compile in parallel
            _, errors = compile_.communicate()
            if compile_.returncode != 0:
                raise RuntimeError(f"compiling {compile_.args[-3]} failed: {errors[-2000:]}")
        result = subprocess.run(link, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"linking {lib.name} failed: {result.stderr[-2000:]}")
        os.replace(Path(tmp) / lib.name, lib)
    logger.info("built the CPU kernels in %.1f s: %s", time.perf_counter() - start, lib)
    return lib


def quant_isas() -> list[str]:
    """The instruction sets the block kernels have rows for that this CPU runs, by the flags
    Linux lists (`ops().quant_isa(name)` forces one; the last is what runs by default)."""
    flags = set(_cpu_flags().partition(":")[2].split())
    isas = ["scalar"]
    if _X86 and {"avx2", "fma", "f16c"} <= flags:
        isas.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            isas.append("avx512_vnni")
    return isas


def _cpu_flags() -> str:
    """The instruction sets -march=native compiled for: a cache shared with another CPU rebuilds."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")
