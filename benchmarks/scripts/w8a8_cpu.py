"""W8A8 linear layers on this CPU: ember's path (x quantized to int8 per token, torch._int_mm:
oneDNN's int8 GEMM, the scales after) against the float paths on the weight dequantized at load
(x quantized and dequantized per token first, so every path computes the W8A8 numbers up to
float32 rounding): float32 oneDNN-prepacked (ember's dense CPU path), float32 F.linear, and
bfloat16 prepacked. Each time is one layer call, best of `reps` (the machine is shared).

    .venv/bin/python benchmarks/scripts/w8a8_cpu.py [--reps 7]

Shapes: SmolLM2-135M's q|k|v, gate|up and down; Llama-3.1-8B's o and down; M = 1 and 64 rows.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F

from ember.layers.quant.w8a8 import W8A8Tensor, W8A8Weight, quantize_tokens

SHAPES = {"SmolLM2-135M q|k|v": (960, 576), "SmolLM2-135M gate|up": (3072, 576), "SmolLM2-135M down": (576, 1536),
          "Llama-8B o": (4096, 4096), "Llama-8B down": (4096, 14336)}


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"{'layer':22} {'M':>3} {'int8 _int_mm':>12} {'f32 prepacked':>13} {'f32 F.linear':>12} "
          f"{'bf16 prepacked':>14}  (ms)")
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) / (127 * k ** 0.5)
        layer = W8A8Weight(W8A8Tensor(weight, scale, None))
        dense = weight.float() * scale[:, None]
        f32 = torch.ops.mkldnn._reorder_linear_weight(dense, 16)
        bf16 = torch.ops.mkldnn._reorder_linear_weight(dense.bfloat16(), 16)
        for m in (1, 64):
            x = torch.randn(m, k, generator=g)

            def dequantized(x: torch.Tensor = x) -> torch.Tensor:
                q, s = quantize_tokens(x, None)
                return q.float() * s

            times = [best_ms(lambda: layer.apply(x), args.reps),
                     best_ms(lambda: torch.ops.mkldnn._linear_pointwise(dequantized(), f32, None, "none", [], ""),
                             args.reps),
                     best_ms(lambda: F.linear(dequantized(), dense), args.reps),
                     best_ms(lambda: torch.ops.mkldnn._linear_pointwise(dequantized().bfloat16(), bf16, None, "none",
                                                                        [], ""), args.reps)]
            print(f"{name:22} {m:3d} {times[0]:12.3f} {times[1]:13.3f} {times[2]:12.3f} {times[3]:14.3f}")


if __name__ == "__main__":
    main()
