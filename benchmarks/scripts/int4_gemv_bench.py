"""Integer (W4A16) weights on the GPU at Llama-3.1-8B's shapes, group 128, AWQ-style (zero points)
and GPTQ-style (symmetric):

    decode, 1 / 2 / 4 / 8 rows: the word GEMV (kernels/int_gemv.py) against the tensor-core
        matmul (kernels/wna16.py, what more rows take), the per-value GEMV of kernels/gemv.py (up
        to its 4 rows) and cuBLAS on the same shape in bf16 (F.linear), with the bandwidth each
        reaches (the weight's bytes, qweight + scales + zeros, over the time);
    prefill, 512 / 2048 rows: kernels/wna16.py's matmul at its wna16_config (and through its
        per-column path, given a g_idx of k // 128) against cuBLAS bf16, in TFLOP/s.

Timed as gemv_bench.py times (a CUDA graph of back-to-back calls over enough weight copies to
defeat the 50 MB L2); the word GEMV alone and with the prologue decode fuses into the layer (the
norm before q|k|v and gate|up, SiLU before down): at one row ptxas gave AWQ's kernel with the
norm more registers than GPTQ's (int_gemv_registers), which the plain call did not show.
--sweep: the word GEMV at each tile of SWEEP (AWQ-style, with the layer's prologue), and the matmul
at each of MATMUL_SWEEP; the best per shape and rows is printed last as a dict to paste into
int_gemv_config (and the matmul's into wna16.py's TUNED); --write writes them there. The sweeps
stop at BUDGET_S.
`cd benchmarks/scripts && python3 int4_gemv_bench.py [--sweep [--write]]`"""

import sys
import time

import torch
import torch.nn.functional as F
import triton
from gemv_bench import SHAPES, time_us, write_tuned

from ember.kernels.gemv import gemv
from ember.kernels.int_gemv import int_gemv, int_gemv_config
from ember.kernels.wna16 import wna16_config, wna16_matmul

ROWS = (1, 2, 4, 8)
PREFILL_ROWS = (512, 2048)
GROUP = 128
# (BLOCK_N, BLOCK_J at one row, num_warps, num_stages); BLOCK_J is divided by the rows (padded to
# a power of two) at more rows, as int_gemv_config does, to keep the accumulator in registers
SWEEP = [(16, 256, 8, 3), (8, 256, 4, 3), (4, 256, 2, 3), (8, 256, 8, 3), (32, 128, 8, 3), (8, 512, 8, 3),
         (16, 256, 8, 2), (16, 256, 8, 4)]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
MATMUL_SWEEP = [(128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                (64, 128, 64, 4, 4), (128, 128, 128, 8, 2), (64, 64, 128, 4, 4)]
BUDGET_S = (150, 200)  # seconds from the start at which the GEMV and matmul sweeps stop: the run stays < 4 min
DEVICE = "cuda"


def int_weights(n: int, k: int, zeros: bool, copies: int) -> list[tuple]:
    """`copies` random 4-bit weights [n, k] in groups of GROUP: (qweight, scales, zeros or None)."""
    groups = k // GROUP
    out = []
    for _ in range(copies):
        q = torch.randint(-2 ** 31, 2 ** 31, (n, k // 8), dtype=torch.int64, device=DEVICE).to(torch.int32)
        s = ((0.5 + torch.rand(n, groups, device=DEVICE)) / (8 * k ** 0.5)).half()
        z = torch.randint(0, 16, (n, groups), device=DEVICE, dtype=torch.uint8) if zeros else None
        out.append((q, s, z))
    return out


def nbytes(w: tuple) -> int:
    return sum(t.nbytes for t in w if t is not None)


def dequantized(w: tuple, k: int) -> torch.Tensor:
    """W = (q - z) * s in float32."""
    q, s, z = w
    shifts = torch.arange(0, 32, 4, device=DEVICE, dtype=torch.int32)
    values = ((q.unsqueeze(-1) >> shifts) & 15).flatten(1).float()
    zero = z.float() if z is not None else torch.full_like(s, 8, dtype=torch.float32)
    return (values - zero.repeat_interleave(GROUP, 1)) * s.float().repeat_interleave(GROUP, 1)


class Case:
    """One shape's weight copies (enough to defeat L2), its bf16 twin for cuBLAS, and its reference."""

    def __init__(self, n: int, k: int, zeros: bool, dense: bool = True) -> None:
        self.n, self.k = n, k
        self.ws = int_weights(n, k, zeros, max(2, -(-400_000_000 // (n * k // 2))))
        self.size = nbytes(self.ws[0])
        self.dense = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k ** 0.5
                      for _ in range(max(2, -(-400_000_000 // (2 * n * k))) if dense else 0)]

    def word(self, x: torch.Tensor, config: tuple | None = None, reps: int = 40, **prologue) -> float:
        return time_us(lambda i: int_gemv(x, *self.ws[i], None, 4, GROUP, config=config, **prologue), len(self.ws),
                       reps)


def decode_input(name: str, rows: int, k: int) -> tuple[torch.Tensor, dict]:
    """x and int_gemv's prologue arguments as a decode step calls the layer (layers/fused.py): the
    norm, with the residual, before q|k|v and gate|up, SiLU before down, none before o."""
    if name.endswith("down"):
        return torch.randn(rows, 2 * k, device=DEVICE, dtype=torch.bfloat16), dict(prologue="silu")
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    if name.endswith(("qkv", "gate_up")):
        return x, dict(prologue="norm", residual=torch.randn_like(x), eps=1e-5,
                       norm_weight=torch.ones(k, device=DEVICE, dtype=torch.bfloat16))
    return x, {}


def decode(name: str, n: int, k: int, zeros: bool) -> None:
    case = Case(n, k, zeros)
    ws, size = case.ws, case.size
    ref = dequantized(ws[0], k)
    style = "awq" if zeros else "gptq"
    for rows in ROWS:
        x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
        err = (int_gemv(x, *ws[0], None, 4, GROUP).float() - F.linear(x.float(), ref)).abs().max().item()
        assert err < 0.05, f"{name} {style} M={rows}: the word GEMV differs from the dequantized weight by {err}"
        t_new = case.word(x)
        x_fused, prologue = decode_input(name, rows, k)
        t_fused = case.word(x_fused, **prologue)  # what decode runs: the layer's prologue fused in
        # the tensor-core matmul at every row count: where it passes the word GEMV sets
        # kernel_paths.INT_GEMV_MAX_ROWS (the GEMV fuses the norm / SiLU prologue, the matmul does not)
        t_mm = time_us(lambda i: wna16_matmul(x, *ws[i], None, 4, GROUP), len(ws))
        t_val = time_us(lambda i: gemv(x, ws[i][0], weight_scale=ws[i][1], weight_zeros=ws[i][2], bits=4,
                                       group_size=GROUP), len(ws)) if rows <= 4 else float("nan")
        t_blas = time_us(lambda i: F.linear(x, case.dense[i]), len(case.dense))
        print(f"{name:12s} {style:4s} M={rows}  word {t_new:7.1f} us {size / t_new / 1e3:5.0f} GB/s (with "
              f"{prologue.get('prologue', 'no')} prologue {t_fused:7.1f} us) | matmul "
              f"{t_mm:7.1f} us {size / t_mm / 1e3:5.0f} GB/s | per-value {t_val:7.1f} us | cuBLAS bf16 {t_blas:7.1f} us "
              f"{2 * n * k / t_blas / 1e3:5.0f} GB/s | word {t_mm / t_new:5.2f}x matmul, {t_blas / t_new:5.2f}x "
              f"cuBLAS  {int_gemv_config(rows, n, k, 4)} {wna16_config(rows, n, k)}", flush=True)


def sweep_decode(shapes: dict, best: dict, start: float) -> None:
    """The word GEMV at each SWEEP tile, AWQ-style, with the prologue decode fuses into each layer,
    rows 1 first (the budget cuts the last rows)."""
    for rows in ROWS:
        m_pad = triton.next_power_of_2(rows)
        for name, (n, k) in shapes.items():
            case = Case(n, k, True, dense=False)
            x, prologue = decode_input(name, rows, k)
            default = int_gemv_config(rows, n, k, 4)
            results = [(case.word(x, reps=20, **prologue), default)]
            for bn, bj, warps, stages in SWEEP:
                config = (bn, max(16, min(bj // m_pad, triton.next_power_of_2(k // 8))), warps, stages)
                if config == default:
                    continue
                if time.time() - start > BUDGET_S[0]:
                    print("    (sweep stopped: time budget)")
                    return
                try:
                    results.append((case.word(x, config, reps=20, **prologue), config))
                except Exception as e:  # out of registers / shared memory
                    print(f"    {config}: {type(e).__name__}")
            results.sort()
            print(f"{name:12s} awq  M={rows} best: " + ", ".join(
                f"{c}: {us:.1f} us {case.size / us / 1e3:.0f} GB/s" for us, c in results[:3])
                + f"  (default {default})", flush=True)
            best[(rows, n, k)] = results[0]


def prefill(name: str, n: int, k: int, sweep: bool, best: dict, start: float) -> None:
    ws = int_weights(n, k, True, 2)
    dense = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k ** 0.5 for _ in range(2)]
    g_idx = (torch.arange(k, device=DEVICE) // GROUP).to(torch.int32)
    for rows in PREFILL_ROWS:
        x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
        flop = 2 * rows * n * k
        t_int = time_us(lambda i: wna16_matmul(x, *ws[i], None, 4, GROUP), 2, reps=10)
        # the same weight through the per-column path (a g_idx that is k // GROUP): each column scaled
        # before the dot, one accumulator, against the grouped path's dot-then-scale into a second one
        t_col = time_us(lambda i: wna16_matmul(x, *ws[i], g_idx, 4, GROUP), 2, reps=10)
        t_blas = time_us(lambda i: F.linear(x, dense[i]), 2, reps=10)
        print(f"{name:12s} awq  M={rows}  wna16 {t_int:8.1f} us {flop / t_int / 1e6:4.0f} TFLOP/s (per-column "
              f"{t_col:8.1f} us {flop / t_col / 1e6:4.0f}) | cuBLAS bf16 {t_blas:8.1f} us {flop / t_blas / 1e6:4.0f} "
              f"TFLOP/s | {t_blas / t_int:5.2f}x cuBLAS  wna16_config {wna16_config(rows, n, k)}", flush=True)
        if sweep:
            results = [(t_int, wna16_config(rows, n, k))]
            for config in MATMUL_SWEEP:
                if time.time() - start > BUDGET_S[1]:
                    print("    (sweep stopped: time budget)")
                    break
                if config == results[0][1]:
                    continue
                try:
                    us = time_us(lambda i, c=config: wna16_matmul(x, *ws[i], None, 4, GROUP, config=c), 2, reps=10)
                except Exception as e:
                    print(f"    {config}: {type(e).__name__}")
                    continue
                results.append((us, config))
            results.sort()
            print("    best: " + ", ".join(f"{c}: {us:.1f} us {flop / us / 1e6:.0f} TFLOP/s" for us, c in results[:3]),
                  flush=True)
            best[(rows, n, k)] = results[0]


def main() -> None:
    sweep = "--sweep" in sys.argv
    start = time.time()
    torch.manual_seed(0)
    shapes = {name: nk for name, nk in SHAPES.items() if name.startswith("8b") and "lm_head" not in name}
    print(f"{torch.cuda.get_device_name()}: W4A16, groups of {GROUP}, bf16 activations")
    best_gemv: dict = {}
    best_matmul: dict = {}
    for zeros in (True, False):
        for name, (n, k) in shapes.items():
            decode(name, n, k, zeros)
    if sweep:
        sweep_decode(shapes, best_gemv, start)
    for name, (n, k) in shapes.items():
        prefill(name, n, k, sweep, best_matmul, start)
    if sweep:
        print("\n# int_gemv_config, measured (rows, N, K): (BLOCK_N, BLOCK_J, num_warps, num_stages)")
        print("TUNED = {" + ",\n         ".join(f"{key}: {c}" for key, (_, c) in sorted(best_gemv.items())) + "}")
        print("# wna16 matmul, measured (rows, N, K): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)")
        print("MATMUL_TUNED = {" + ",\n                ".join(f"{key}: {c}" for key, (_, c) in
                                                          sorted(best_matmul.items())) + "}")
        if "--write" in sys.argv:
            write_tuned("ember/kernels/int_gemv.py", "TUNED", {key: c for key, (_, c) in best_gemv.items()})
            write_tuned("ember/kernels/wna16.py", "TUNED", {key: c for key, (_, c) in best_matmul.items()})
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
