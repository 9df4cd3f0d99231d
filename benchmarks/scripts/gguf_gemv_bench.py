"""GGUF blocks on the GPU at decode, Llama-3.1-8B's shapes, 1 / 2 / 4 rows of bf16 x: the word
GEMV (kernels/gguf_gemv.py) against the per-value GEMV it replaces (kernels/gguf.py, per_value)
and cuBLAS on the same shape in bf16 (F.linear), for Q4_K and Q6_K (a Q4_K_M file's types) and
Q4_1 (the default model's), with the bandwidth each reaches (the planes' bytes over the time;
cuBLAS: the bf16 weight's). Each word GEMV is first checked against the float32 matmul over the
weight the rows kernel dequantizes. Timed as gemv_bench.py times (a CUDA graph of back-to-back
calls over enough weight copies to defeat the 50 MB L2).

--sweep: the word GEMV at each tile of SWEEP too, one row first (each tile compiles once a type,
rows and K); the best a type, rows and shape printed last as a TUNED dict to paste into
kernels/gguf_gemv.py (--write writes it there). The sweep stops at BUDGET_S: the whole run stays
under 4 minutes. `cd benchmarks/scripts && python3 gguf_gemv_bench.py [--sweep [--write]]`"""

import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import triton
from gemv_bench import SHAPES, time_us, write_tuned

from ember.bench.dummy_gguf import random_blocks
from ember.kernels.gguf import gguf_gemv
from ember.kernels.gguf_gemv import gguf_word_gemv_config
from ember.layers.quant.gguf_blocks import BlockTensor
from ember.layers.quant.gguf_cuda import GGUFCudaBlocks

TYPES = {"Q4_K": 12, "Q6_K": 14, "Q4_1": 3}
ROWS = (1, 2, 4)
PER = {8: 4, 14: 16}  # values an int32 word of the word kernel (else 8)
# (BLOCK_N, values a step at one row, num_warps, num_stages): BLOCK_J = values / PER / rows (padded to
# a power of two), as gguf_word_gemv_config divides it, so the accumulators keep to the registers
SWEEP = [(16, 2048, 8, 3), (8, 2048, 4, 3), (4, 2048, 2, 3), (16, 1024, 4, 3), (32, 1024, 8, 3), (8, 4096, 8, 3),
         (16, 2048, 8, 2), (16, 2048, 8, 4)]
BUDGET_S = 170
L2_DEFEAT = 400_000_000  # bytes of weight copies a timing cycles through


class Case:
    """One type and shape: copies of a random weight's planes (enough to defeat L2) and the float32
    weight the rows kernel dequantizes (the reference)."""

    def __init__(self, name: str, qtype: int, n: int, k: int, rng: np.random.Generator) -> None:
        self.qtype, self.n, self.k = qtype, n, k
        raw = torch.from_numpy(random_blocks(rng, name, n, k)).cuda()
        first = GGUFCudaBlocks(BlockTensor(qtype, (n, k), raw))
        self.nbytes = first.nbytes
        copies = max(2, -(-L2_DEFEAT // self.nbytes))
        self.planes = [first.planes.kernel_args()] + [
            GGUFCudaBlocks(BlockTensor(qtype, (n, k), raw.clone())).planes.kernel_args() for _ in range(copies - 1)]
        self.dense = first.dequantize(torch.float32)

    def time(self, x: torch.Tensor, per_value: bool = False, config: tuple | None = None, reps: int = 40) -> float:
        return time_us(lambda i: gguf_gemv(x, self.qtype, self.planes[i], self.n, config=config, per_value=per_value),
                       len(self.planes), reps)


def decode(shape: str, case: Case, name: str, blas: dict) -> None:
    for rows in ROWS:
        x = torch.randn(rows, case.k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x.float(), case.dense)
        got = gguf_gemv(x, case.qtype, case.planes[0], case.n).float()
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-2, f"{shape} {name} M={rows}: the word GEMV is {err:.1e} of |y| off the reference"
        t_new, t_old = case.time(x), case.time(x, per_value=True)
        size = case.nbytes
        print(f"{shape:12s} {name} M={rows}  word {t_new:7.1f} us {size / t_new / 1e3:5.0f} GB/s | per-value "
              f"{t_old:7.1f} us {size / t_old / 1e3:5.0f} GB/s | cuBLAS bf16 {blas[rows]:7.1f} us "
              f"{2 * case.n * case.k / blas[rows] / 1e3:5.0f} GB/s | word {t_old / t_new:5.2f}x per-value, "
              f"{blas[rows] / t_new:5.2f}x cuBLAS  {gguf_word_gemv_config(case.qtype, rows, case.n, case.k)}",
              flush=True)


def sweep(shape: str, case: Case, name: str, rows: int, best: dict, start: float) -> bool:
    """The word GEMV at each SWEEP tile; False once the budget is spent."""
    m_pad = triton.next_power_of_2(rows)
    x = torch.randn(rows, case.k, device="cuda", dtype=torch.bfloat16)
    default = gguf_word_gemv_config(case.qtype, rows, case.n, case.k)
    results = [(case.time(x, reps=20), default)]
    per = PER.get(case.qtype, 8)
    for block_n, values, warps, stages in SWEEP:
        config = (block_n, max(8, min(values // per // m_pad, triton.next_power_of_2(case.k // per))), warps, stages)
        if config == default:
            continue
        if time.time() - start > BUDGET_S:
            print("    (sweep stopped: time budget)")
            return False
        try:
            results.append((case.time(x, config=config, reps=20), config))
        except Exception as e:  # out of registers / shared memory
            print(f"    {config}: {type(e).__name__}")
    results.sort()
    print(f"{shape:12s} {name} M={rows} best: " + ", ".join(
        f"{c}: {us:.1f} us {case.nbytes / us / 1e3:.0f} GB/s" for us, c in results[:3]) + f"  (default {default})",
        flush=True)
    best[(case.qtype, m_pad, case.n, case.k)] = results[0]
    return True


def main() -> None:
    sweeping = "--sweep" in sys.argv
    start = time.time()
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    shapes = {name: nk for name, nk in SHAPES.items() if name.startswith("8b") and "lm_head" not in name}
    print(f"{torch.cuda.get_device_name()}: GGUF blocks, bf16 activations")
    best: dict = {}
    cases = []
    for shape, (n, k) in shapes.items():
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                 for _ in range(max(2, -(-L2_DEFEAT // (2 * n * k))))]
        blas = {rows: time_us(lambda i, x=torch.randn(rows, k, device="cuda", dtype=torch.bfloat16): F.linear(x, dense[i]),
                              len(dense)) for rows in ROWS}
        dense.clear()
        for name, qtype in TYPES.items():
            case = Case(name, qtype, n, k, rng)
            decode(shape, case, name, blas)
            case.dense = None
            if sweeping:
                cases.append((shape, name, case))  # its copies: ~400 MB
    for rows in ROWS if sweeping else ():
        if not all(sweep(shape, case, name, rows, best, start) for shape, name, case in cases):
            break
    if sweeping:
        print("\n# gguf_word_gemv_config, measured (qtype, rows, N, K): (BLOCK_N, BLOCK_J, num_warps, num_stages)")
        print("TUNED = {" + ",\n         ".join(f"{key}: {c}" for key, (_, c) in sorted(best.items())) + "}")
        if "--write" in sys.argv:
            write_tuned("ember/kernels/gguf_gemv.py", "TUNED", {key: c for key, (_, c) in best.items()})
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
