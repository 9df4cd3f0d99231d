"""Small-batch linear layers on the GPU: cuBLAS (F.linear) against ember's GEMV kernel
(kernels/gemv.py) and its fused prologues, at the Qwen3-0.6B and Llama-3.1-8B decode
shapes, 1 / 2 / 4 rows (--tp2: the Llama-3.1-8B shapes one rank of two holds). Each case is
timed inside a CUDA graph of back-to-back calls (as a decode graph replays them) that cycle
over enough weight copies to defeat the 50 MB L2.
`python3 benchmarks/scripts/gemv_bench.py [--sweep] [--tp2]`"""

import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.kernels.activation import silu_and_mul
from ember.kernels.gemv import gemv, gemv_config
from ember.kernels.rms_norm import rms_norm

SHAPES = {  # name: (N, K) of weight [N, K]
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
    "0.6b lm_head": (151936, 1024),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
    "8b lm_head": (128256, 4096),
}
TP2_SHAPES = {  # a rank of two: column-parallel layers keep half the rows, row-parallel half the columns
    "8b/2 qkv": (3072, 4096), "8b/2 o": (4096, 2048), "8b/2 gate_up": (14336, 4096), "8b/2 down": (4096, 7168),
    "8b/2 lm_head": (64128, 4096),
}


SWEEP = [(4, 512, 4), (8, 512, 4), (16, 512, 4), (8, 256, 4), (16, 256, 4), (32, 256, 4), (8, 1024, 8),
         (16, 512, 8), (4, 1024, 4), (8, 1024, 4), (16, 1024, 8), (4, 2048, 8), (8, 2048, 8), (2, 2048, 4),
         (32, 512, 8)]  # (BLOCK_N, BLOCK_K, num_warps) at one row; the long tiles are for fp8 weights


def write_tuned(source: str, name: str, best: dict) -> None:
    """Rewrite the `NAME: dict[...] = {...}` line of the ember module `source` (a path from the repo
    root, e.g. "ember/kernels/int_gemv.py") with the measured {key: config}: `--write` of the
    sweeps, so a device call can sweep and then run the engine on the tuned tiles (the file is
    copied to $OUT by h200.sh and committed from there)."""
    path = Path(__file__).resolve().parents[2] / source
    text = path.read_text()
    entries = "".join(f"\n    {key}: {config}," for key, config in sorted(best.items()))
    body = "{" + entries + ("\n}" if entries else "}")
    new, count = re.subn(rf"^({name}: dict\[.*?\] = )\{{[^}}]*\}}$", lambda m: m.group(1) + body, text, count=1,
                         flags=re.M)
    if count != 1:
        raise ValueError(f"{source} has no `{name}: dict[...] = {{...}}` line to rewrite")
    path.write_text(new)
    print(f"wrote {len(best)} entries into {source}'s {name}")


def time_us(fn, copies: int, reps: int = 40) -> float:
    """Mean µs per call of fn(i) for i cycling over the copies, replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def sweep_configs(run, copies: int) -> list[tuple[float, int, int, int]]:
    """(µs, BLOCK_N, BLOCK_K, warps) of run(i, config) at each SWEEP config, fastest first."""
    rows = []
    for bn, bk, nwarps in SWEEP:
        try:
            rows.append((time_us(lambda i: run(i, (bn, bk, nwarps)), copies, reps=20), bn, bk, nwarps))
        except Exception as e:  # out of registers / shared memory
            print(f"    {bn},{bk},{nwarps}: {type(e).__name__}")
    return sorted(rows)


def _best(rows: list[tuple[float, int, int, int]]) -> str:
    return ", ".join(f"{bn},{bk},{w}: {t:.1f}" for t, bn, bk, w in rows[:4])


def main(sweep: bool, shapes: dict[str, tuple[int, int]]) -> None:
    torch.manual_seed(0)
    dt = torch.bfloat16
    print(f"{'shape':14s} M  {'cuBLAS':>8s} {'gemv':>8s} {'TB/s':>5s}/{'TB/s':>5s}  norm+lin fused / unfused   "
          f"silu+lin fused / unfused  (us)")
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(1, -(-400_000_000 // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(copies)]
        nw = torch.ones(k, device="cuda", dtype=dt)
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            res = torch.randn(m, k, device="cuda", dtype=dt)
            gu = torch.randn(m, 2 * k, device="cuda", dtype=dt)
            err = (gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
            assert err < 0.05, f"{name} M={m}: gemv differs from F.linear by {err}"
            t_blas = time_us(lambda i: F.linear(x, ws[i]), copies)
            t_gemv = time_us(lambda i: gemv(x, ws[i]), copies)
            line = (f"{name:14s} {m}  {t_blas:8.1f} {t_gemv:8.1f} {nbytes / t_blas / 1e6:5.2f}/"
                    f"{nbytes / t_gemv / 1e6:5.2f}")
            if "lm_head" not in name and m == 1:
                t_nf = time_us(lambda i: gemv(x, ws[i], prologue="norm", residual=res, norm_weight=nw), copies)
                t_nu = time_us(lambda i: F.linear(rms_norm(x, nw, 1e-6, res), ws[i]),
                               copies)
                t_sf = time_us(lambda i: gemv(gu, ws[i], prologue="silu"), copies)
                t_su = time_us(lambda i: F.linear(silu_and_mul(gu), ws[i]), copies)
                line += f"   {t_nf:8.1f} / {t_nu:8.1f}        {t_sf:8.1f} / {t_su:8.1f}"
            print(line, flush=True)
            if sweep and m == 1:
                rows = sweep_configs(lambda i, config: gemv(x, ws[i], config=config), copies)
                print(f"    default {gemv_config(m, n, k)}; best: {_best(rows)}", flush=True)
                if "qkv" in name:  # decode runs it with the norm prologue
                    rows = sweep_configs(lambda i, config: gemv(x, ws[i], prologue="norm", residual=res,
                                                                norm_weight=nw, config=config), copies)
                    print(f"    with the norm prologue, best: {_best(rows)}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main("--sweep" in sys.argv, TP2_SHAPES if "--tp2" in sys.argv else SHAPES)
