"""W8A8 matmuls on the GPU at the Llama-3.1-8B linear shapes, to set kernels/int8.py's tile
configs (int8_config). µs per call for M rows (decode batches, prefill chunks), each timed
inside a CUDA graph cycling over weight copies past the 50 MB L2 (gemv_bench.time_us):

    bf16     F.linear on the bf16 weight (cuBLAS): the baseline
    w8a8     ember's path: the activations quantized per token, then the int8 matmul
    quant    the quantization alone
    mm       kernels/int8.py's matmul alone, at int8_config's tiles
    int_mm   torch._int_mm (cuBLASLt's int8 GEMM; M > 16) with the scales in torch: what cuBLAS
             reaches on the same numbers

With --sweep, the matmul's other tiles at each M (every one must give the default's bits: the
int32 sums are exact), fastest first. `python3 benchmarks/scripts/int8_gemm_bench.py [--sweep]`"""

import sys

import torch
import torch.nn.functional as F
from gemv_bench import SHAPES, time_us

from ember.kernels.int8 import int8_config, int8_matmul, quantize_tokens
from ember.layers.quant.w8a8 import AMAX_FLOOR, quantize_w8a8

ROWS = [1, 4, 16, 64, 256, 512, 2048, 8192]
COLUMNS = ["bf16", "w8a8", "quant", "mm", "int_mm"]
SWEEP = {  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by row count
    "decode": [(16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4),
               (16, 32, 512, 4, 3), (16, 64, 512, 4, 3), (16, 128, 256, 4, 3), (16, 32, 128, 4, 5)],
    "prefill": [(64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 256, 4, 3), (64, 256, 128, 8, 3),
                (64, 256, 128, 4, 3), (128, 128, 128, 8, 3), (128, 128, 128, 4, 4), (128, 256, 128, 8, 3),
                (128, 128, 256, 8, 3), (128, 64, 128, 4, 4), (256, 128, 128, 8, 3), (128, 256, 64, 8, 4)],
}


def main(sweep: bool) -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'shape':10s} {'M':>5s} " + " ".join(f"{c:>8s}" for c in COLUMNS) + "   (us)")
    for name, (n, k) in SHAPES.items():
        if not name.startswith("8b") or "lm_head" in name:
            continue
        copies16 = max(1, -(-400_000_000 // (2 * n * k)))
        copies8 = max(1, -(-400_000_000 // (n * k)))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies16)]
        w8 = [quantize_w8a8(w16[i % copies16]) for i in range(copies8)]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, s = quantize_tokens(x, None, AMAX_FLOOR)
            want = int8_matmul(q, s, w8[0].weight, w8[0].scale, None, torch.bfloat16)

            def int_mm(i):
                return (torch._int_mm(q, w8[i].weight.t()).float() * s * w8[i].scale).to(torch.bfloat16)

            cases = {"bf16": lambda i: F.linear(x, w16[i % copies16]),
                     "w8a8": lambda i: int8_matmul(*quantize_tokens(x, None, AMAX_FLOOR), w8[i].weight, w8[i].scale,
                                                   None, torch.bfloat16),
                     "quant": lambda i: quantize_tokens(x, None, AMAX_FLOOR),
                     "mm": lambda i: int8_matmul(q, s, w8[i].weight, w8[i].scale, None, torch.bfloat16)}
            if m > 16:
                assert torch.equal(int_mm(0), want), "cuBLAS's int8 sums differ from the kernel's"
                cases["int_mm"] = int_mm
            times = {c: time_us(fn, copies8) for c, fn in cases.items()}
            cells = [f"{times[c]:8.1f}" if c in times else f"{'-':>8s}" for c in COLUMNS]
            print(f"{name:10s} {m:5d} " + " ".join(cells), flush=True)
            if sweep and m in (1, 16, 64, 256, 512):
                rows = []
                for config in SWEEP["decode" if m <= 16 else "prefill"]:
                    try:
                        got = int8_matmul(q, s, w8[0].weight, w8[0].scale, None, torch.bfloat16, config)
                        assert torch.equal(got, want), f"{config} gives other bits"
                        rows.append((time_us(lambda i: int8_matmul(q, s, w8[i].weight, w8[i].scale, None,
                                                                   torch.bfloat16, config), copies8, reps=20), config))
                    except Exception as e:  # out of shared memory / registers
                        print(f"    {config}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                rows.sort()
                print(f"    default {int8_config(m, n)}: {times['mm']:.1f}; best: " + ", ".join(
                    f"{c}: {t:.1f}" for t, c in rows[:4]), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main("--sweep" in sys.argv)
