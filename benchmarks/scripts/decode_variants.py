"""The decode split kernel's variants (decode_attention.VARIANT_FLAGS) x a few configs on the
GPU, at the two big benchmark shapes, with an fp8 and a bfloat16 cache: time, KV bandwidth,
and the max abs difference from the plain kernel at its default config (must be < 2e-2).
Compiles everything first on a thread pool (Triton's AsyncCompileMode), then times; stops
timing at a deadline (~140 s in all). Last lines: `BEST <shape> <dtype> <variant config>`.
`python3 benchmarks/scripts/decode_variants.py [fp8|bf16] [--serial]`"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from triton.testing import do_bench

from decode_sweep import case
import ember.kernels.decode_attention as da

T0 = time.monotonic()
DEADLINE_S = 140.0
PRECOMPILE_S = 100.0
SHAPES = {"qwen3-0.6b": (256, 16, 8, 100, 2048),   # bs256, ctx U[100,2048]
          "llama-8b": (512, 32, 8, 1000, 2000)}    # bs512, ctx U[1000,2000]
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
SCALE = 0.088


@dataclass(frozen=True)
class Run:
    variant: str
    block_n: int
    warps: int
    stages: int
    split_x: int = 1  # splits: split_x x num_decode_splits(batch)

    def label(self, width: int = 16) -> str:
        x = f" splits x{self.split_x}" if self.split_x > 1 else ""
        return f"{self.variant or 'plain':{width}s} {self.block_n},{self.warps},{self.stages}{x}"


PLAIN = Run("", 128, 4, 4)  # the current default: the reference of every row
# most promising first (the deadline cuts the tail): vreg (V converted in registers, no
# byte-wise shared-memory reads; +32 KB of shared memory, so stages / BLOCK_N matter), K as
# the A operand (a wgmma with M = BLOCK_N), then the rest
GRID = {
    "fp8": [PLAIN, Run("vreg", 128, 4, 4), Run("vreg", 128, 4, 3), Run("kreg+vreg", 128, 4, 4), Run("vreg", 64, 4, 4),
            Run("vreg", 128, 8, 3), Run("ka+vreg", 128, 4, 4), Run("ka+kreg+vreg", 128, 4, 3), Run("vreg", 128, 4, 2),
            Run("vreg+pages+i32", 128, 4, 3), Run("ka", 128, 4, 4), Run("ka+va", 128, 4, 4), Run("vreg", 64, 4, 3),
            Run("vreg", 128, 4, 3, split_x=2), Run("kt", 128, 4, 4), Run("", 256, 8, 2)],
    "bf16": [PLAIN, Run("vreg", 128, 4, 4), Run("ka", 128, 4, 4), Run("ka+va", 128, 4, 4), Run("kt", 128, 4, 4),
             Run("pages+i32", 128, 4, 4), Run("ka", 128, 8, 3), Run("va", 128, 4, 4), Run("", 64, 4, 3),
             Run("", 128, 4, 4, split_x=2)],
}


def call(run: Run, q, kc, vc, tables, lens, splits):
    return da.decode_attention(q, kc, vc, tables, lens, SCALE, splits * run.split_x, block_n=run.block_n,
                               num_warps=run.warps, num_stages=run.stages, variant=run.variant)


def brief(e: Exception) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[-1][:140] if lines else ''}"


class _WarmupOnly:
    """Stands in for a kernel: `k[grid](...)` compiles (asynchronously) without launching."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn.warmup(*args, grid=grid, **kwargs)


@contextmanager
def warmup_only():
    kernels = {name: getattr(da, name) for name in ("_decode_split_kernel", "_decode_merge_kernel")}
    for name, fn in kernels.items():
        setattr(da, name, _WarmupOnly(fn))
    try:
        yield
    finally:
        for name, fn in kernels.items():
            setattr(da, name, fn)


def precompile(jobs) -> None:
    """Compiles every (run, case), in the order given, on a thread pool; what is not done
    by PRECOMPILE_S compiles when timed (if before the deadline). Errors surface then too."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        print("no AsyncCompileMode: compiling serially")
        return
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool:
        mode = AsyncCompileMode(pool, ignore_errors=True)
        with mode, warmup_only():
            for run, args in jobs:
                try:
                    call(run, *args)
                except Exception as e:  # noqa: BLE001 (reported when timed)
                    print(f"  precompile {run.label()}: {brief(e)}")
            done, late = wait(mode.raw_futures, timeout=max(1.0, PRECOMPILE_S - (time.monotonic() - T0)))
            for future in late:
                future.cancel()
    print(f"compiled {len(done)} kernels ({len(late)} left) by {time.monotonic() - T0:.0f} s", flush=True)


def main() -> None:
    dtypes = [a for a in sys.argv[1:] if a in DTYPES] or list(DTYPES)
    cases = {}
    for shape, (batch, heads, kv_heads, lo, hi) in SHAPES.items():
        for dt in dtypes:
            q, kc, vc, tables, lens, nbytes = case(batch, heads, kv_heads, lo, hi, kv_dtype=DTYPES[dt])
            cases[shape, dt] = ((q, kc, vc, tables, lens, da.num_decode_splits(batch, kv_heads)), nbytes)
    if "--serial" not in sys.argv:
        # row i of every grid before row i + 1 of any: the most promising compile first
        jobs = [(i, run, args) for (shape, dt), (args, _) in cases.items() for i, run in enumerate(GRID[dt])]
        try:
            precompile([(run, args) for i, run, args in sorted(jobs, key=lambda j: j[0])])
        except Exception as e:  # noqa: BLE001 (then each compiles when first timed)
            print(f"precompile failed, compiling serially: {brief(e)}")
    best = {}
    for (shape, dt), (args, nbytes) in cases.items():
        print(f"\n{shape} {dt} cache: {nbytes / 1e9:.2f} GB of KV, {args[-1]} split(s) by default", flush=True)
        ref = call(PLAIN, *args).float()
        rows, skipped = [], 0
        for run in GRID[dt]:
            if time.monotonic() - T0 > DEADLINE_S:
                skipped += 1
                continue
            try:
                diff = (call(run, *args).float() - ref).abs().max().item()
                if not diff < 2e-2:
                    print(f"  {run.label()}: WRONG, max abs diff {diff:.3g}")
                    continue
                ms = do_bench(lambda: call(run, *args), warmup=5, rep=25)
                rows.append((ms, run, diff))
            except Exception as e:  # noqa: BLE001 (out of shared memory, a compile error)
                print(f"  {run.label()}: {brief(e)}")
        rows.sort(key=lambda r: r[0])
        plain = next((ms for ms, run, _ in rows if run == PLAIN), None)
        for ms, run, diff in rows:
            vs = f"  x{plain / ms:.2f} vs plain" if plain else ""
            print(f"  {run.label()}: {ms * 1e3:7.1f} us  {nbytes / ms / 1e6:6.0f} GB/s  diff {diff:.1e}{vs}")
        if skipped:
            print(f"  ({skipped} skipped: past the {DEADLINE_S:.0f} s deadline)")
        if rows:
            best[shape, dt] = rows[0]
    print(f"\ntotal {time.monotonic() - T0:.0f} s")
    for (shape, dt), (ms, run, _) in best.items():
        print(f"BEST {shape} {dt} {run.label(0)} ({ms * 1e3:.1f} us)")


if __name__ == "__main__":
    main()
