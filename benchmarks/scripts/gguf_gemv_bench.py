"""GGUF blocks on the GPU at decode: kernels/gguf.py's GEMV (one row) on Q4_K and Q6_K weights
against cuBLAS on the same weight in bf16, at the Llama-3.1-8B shapes, with the bandwidth each
reaches (the weight's bytes over the time). Timed as gemv_bench.py times (a CUDA graph of
back-to-back calls over enough weight copies to defeat L2). --sweep: every (BLOCK_N, GROUPS,
num_warps) of SWEEP, the best a shape printed last (what gemv_config should pick).
`python3 benchmarks/scripts/gguf_gemv_bench.py [--sweep]`"""

import sys

import torch
import torch.nn.functional as F
from gemv_bench import SHAPES, time_us

from ember.bench.dummy_gguf import random_blocks
from ember.kernels.gguf import gemv_config, gguf_gemv
from ember.layers.quant.gguf_blocks import KERNEL_TYPES, BlockTensor
from ember.layers.quant.gguf_cuda import GGUFCudaBlocks

TYPES = {"Q4_K": 12, "Q6_K": 14}
SWEEP = [(1, 32, 4), (2, 32, 4), (4, 32, 4), (8, 32, 4), (16, 32, 4), (4, 64, 4), (8, 64, 4), (8, 16, 4),
         (16, 16, 4), (8, 32, 8), (16, 32, 8), (32, 16, 8)]


def main() -> None:
    import numpy as np

    sweep = "--sweep" in sys.argv
    rng = np.random.default_rng(0)
    for shape, (n, k) in SHAPES.items():
        if not shape.startswith("8b"):
            continue
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(3)]
        bf16 = time_us(lambda i: F.linear(x, dense[i]), len(dense))
        print(f"{shape:14s} [{n}, {k}] bf16 cuBLAS {bf16:8.1f} us {2 * n * k / bf16 / 1e3:7.0f} GB/s")
        dense.clear()
        for name, qtype in TYPES.items():
            raw = torch.from_numpy(random_blocks(rng, name, n, k))
            layers = [GGUFCudaBlocks(BlockTensor(qtype, (n, k), raw).to("cuda")) for _ in range(6)]
            nbytes = layers[0].nbytes
            configs = SWEEP if sweep else [gemv_config(n)]
            results = []
            for config in configs:
                us = time_us(lambda i, c=config: gguf_gemv(x, qtype, layers[i].planes.kernel_args(), n, config=c),
                             len(layers))
                results.append((us, config))
                print(f"{shape:14s} {name} {config} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s "
                      f"({bf16 / us:.2f}x bf16; {KERNEL_TYPES[qtype][2] * 8 / KERNEL_TYPES[qtype][1]:.2f} bits)")
            if sweep:
                us, config = min(results)
                print(f"BEST {shape} {name} {config} {us:.1f} us")
            layers.clear()


if __name__ == "__main__":
    main()
