"""FP8 weights' matmuls on the GPU at the Llama-3.1-8B linear shapes, to set the per-shape
rule of layers/quant/fp8.py (FP8_GEMV_MAX_ROWS in layers/kernel_paths.py) and to see what
the Triton kernels leave on the table. µs per call for M rows (decode batches, prefill
chunks), each timed inside a CUDA graph cycling over weight copies past the 50 MB L2
(gemv_bench.time_us):

    bf16      F.linear on the bf16 weight (cuBLAS): the baseline
    gemv8     the weight-only fp8 GEMV (kernels/gemv.py; M <= 4)
    q+smm     the activations quantized per token (kernels/fp8.py) + torch._scaled_mm with
              rowwise scales: ember's path above FP8_GEMV_MAX_ROWS
    fast      the same with use_fast_accum=True (not what ember runs)
    quant     the activation quantization alone
    tri       kernels/fp8.py's Triton matmul on per-row scales (the fallback for odd shapes)
    blk       per-token-per-128 quantization + the Triton block-scaled matmul (block checkpoints)
    blk-smm   the same scales through torch._scaled_mm's blockwise 1x128 x 128x128 recipe,
              where this torch and cuBLAS take it (else the reason)

Then the largest M at which gemv8 beats q+smm at every shape (what FP8_GEMV_MAX_ROWS should
be), and with --sweep the fp8 GEMV's best (BLOCK_N, BLOCK_K, warps) at one row.
`python3 benchmarks/scripts/fp8_gemm_bench.py [--sweep]`"""

import sys

import torch
import torch.nn.functional as F
from gemv_bench import SHAPES, sweep_configs, time_us

from ember.kernels.fp8 import fp8_matmul, quantize_groups
from ember.kernels.gemv import gemv, gemv_config
from ember.layers.quant.fp8 import AMAX_FLOOR, quantize_weight

ROWS = [1] if "--m1" in sys.argv else [1, 2, 4, 8, 16, 64, 256, 512, 2048]
COLUMNS = ["bf16", "gemv8", "q+smm", "fast", "quant", "tri", "blk", "blk-smm"]


def cases(x, w8, ws, wsb, w16):
    """name -> fn(i) over weight copy i, for x [M, K]."""
    m = x.shape[0]

    def q_smm(i, fast=False):
        q, s = quantize_groups(x, None, AMAX_FLOOR)
        return torch._scaled_mm(q, w8[i].t(), scale_a=s, scale_b=ws[i].view(1, -1), out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    def blk_smm(i):
        q, s = quantize_groups(x, 128, AMAX_FLOOR)
        return torch._scaled_mm(q, w8[i].t(), scale_a=s.t().contiguous().t(), scale_b=wsb[i].t(),
                                out_dtype=torch.bfloat16)

    def tri(i):
        q, s = quantize_groups(x, None, AMAX_FLOOR)
        return fp8_matmul(q, s, w8[i], ws[i], None, torch.bfloat16)

    def blk(i):
        q, s = quantize_groups(x, 128, AMAX_FLOOR)
        return fp8_matmul(q, s, w8[i], wsb[i], None, torch.bfloat16)

    out = {"bf16": lambda i: F.linear(x, w16[i % len(w16)]), "q+smm": q_smm, "fast": lambda i: q_smm(i, True),
           "quant": lambda i: quantize_groups(x, None, AMAX_FLOOR), "tri": tri, "blk": blk, "blk-smm": blk_smm}
    if m <= 4:
        out["gemv8"] = lambda i: gemv(x, w8[i], weight_scale=ws[i])
    return out


def main(sweep: bool) -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'shape':10s} {'M':>5s} " + " ".join(f"{c:>8s}" for c in COLUMNS) + "   (us)")
    gemv_wins: dict[int, bool] = {}
    for name, (n, k) in SHAPES.items():
        if not name.startswith("8b") or "lm_head" in name:
            continue
        copies16 = max(1, -(-400_000_000 // (2 * n * k)))
        copies8 = max(1, -(-400_000_000 // (n * k)))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies16)]
        per_row = [quantize_weight(w16[i % copies16]) for i in range(copies8)]
        w8, ws = [t.weight for t in per_row], [t.scale for t in per_row]
        # the same values with a scale per 128 x 128 block (the timing does not depend on them)
        wsb = [torch.rand(-(-n // 128), -(-k // 128), device="cuda") / 448 for _ in range(copies8)]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x.float(), per_row[0].dequantize())
            times = {}
            for col, fn in cases(x, w8, ws, wsb, w16).items():
                try:
                    if col in ("gemv8", "q+smm", "tri"):
                        err = (fn(0).float() - want).abs().max().item() / want.abs().max().item()
                        assert err < 0.1, f"{col} differs from the dequantized matmul by {err:.3f} (relative)"
                    times[col] = time_us(fn, copies8)
                except Exception as e:  # a recipe this torch / cuBLAS does not take
                    times[col] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}" if col == "blk-smm" else None
                    if col != "blk-smm":
                        raise
            cells = [f"{times[c]:8.1f}" if isinstance(times.get(c), float) else f"{'-':>8s}" for c in COLUMNS]
            print(f"{name:10s} {m:5d} " + " ".join(cells), flush=True)
            if isinstance(times.get("blk-smm"), str) and m == 1:
                print(f"    blk-smm: {times['blk-smm']}")
            if "gemv8" in times:
                gemv_wins[m] = gemv_wins.get(m, True) and times["gemv8"] < times["q+smm"]
            if sweep and m == 1:
                rows = sweep_configs(lambda i, config: gemv(x, w8[i], weight_scale=ws[i], config=config), copies8)
                print(f"    fp8 GEMV default {gemv_config(1, n, k)}; best: " + ", ".join(
                    f"{bn},{bk},{w}: {t:.1f}" for t, bn, bk, w in rows[:4]), flush=True)
        torch.cuda.empty_cache()
    best = max([m for m, wins in gemv_wins.items() if wins and all(gemv_wins.get(r, False) for r in ROWS if r < m)],
               default=0)
    print(f"FP8_GEMV_MAX_ROWS: the fp8 GEMV beats quantize + _scaled_mm at every shape up to M = {best} "
          f"(layers/kernel_paths.py has 4; 0: never)")


if __name__ == "__main__":
    main("--sweep" in sys.argv)
